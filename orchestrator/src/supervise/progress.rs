//! The progress line on stderr during long phases the stages report (`Msg::Progress`): the
//! trunk load (bytes loaded of the total, from the trunk-loader), the prefill (the first
//! pass, which takes the whole prompt through one layer at a time: layers done of the
//! model's, as the trunk-loader sees them) and, for a prompt fed in several passes, the
//! prompt tokens in so far (from compute), each with an ETA from the rate so far.
//!
//! On a terminal the line is rewritten in place (`\r`) and cleared when the phase ends. When
//! stderr is not a terminal (a log, a pipe) only the end of each phase is printed, as one
//! plain line. `--quiet` turns it off.

use std::io::{IsTerminal, Write};
use std::time::Instant;

use k3_protocol::messages::Stage;

/// The progress line's state.
pub struct Progress {
    enabled: bool,
    tty: bool,
    /// The phase shown now and when it started.
    current: Option<(String, Instant)>,
    last_draw: Option<Instant>,
    /// Tokens of the prompt (named in the prefill's line).
    prompt_tokens: Option<usize>,
    /// The prompt is fed in several passes: compute's count of tokens in is the prefill's
    /// line (the trunk-loader's layers of the first pass are not the prefill).
    in_passes: bool,
}

impl Progress {
    pub fn new(enabled: bool) -> Progress {
        Progress {
            enabled,
            tty: std::io::stderr().is_terminal(),
            current: None,
            last_draw: None,
            prompt_tokens: None,
            in_passes: false,
        }
    }

    /// The prompt's length, for the prefill's line.
    pub fn set_prompt_tokens(&mut self, n: usize) {
        self.prompt_tokens = Some(n);
    }

    /// The prompt is fed in several passes (see the field).
    pub fn set_prefill_in_passes(&mut self) {
        self.in_passes = true;
    }

    /// Clear a line drawn on the terminal (before other output goes to stderr).
    pub fn clear(&mut self) {
        if self.tty && self.last_draw.take().is_some() {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
    }

    /// A stage reported `done` of `total` in `phase`.
    pub fn update(&mut self, stage: Stage, phase: &str, done: u64, total: u64) {
        if !self.enabled || total == 0 || (self.in_passes && phase == "prefill") {
            return;
        }
        let key = format!("{stage} {phase}");
        let t0 = match &self.current {
            Some((k, t)) if *k == key => *t,
            _ => {
                let now = Instant::now();
                self.current = Some((key.clone(), now));
                now
            }
        };
        let secs = t0.elapsed().as_secs_f64();
        let finished = done >= total;
        let what = if phase == "load" {
            format!(
                "{stage}: loading the trunk {} of {}",
                crate::units::human(done),
                crate::units::human(total)
            )
        } else if phase == "prefill-passes" {
            format!("prefill of {total} tokens in passes: {done} tokens in")
        } else if phase == "prefill" {
            match self.prompt_tokens {
                Some(n) => format!("prefill of {n} tokens: layer {done} of {total}"),
                None => format!("prefill: layer {done} of {total}"),
            }
        } else {
            format!("{stage}: {phase}: {done} of {total}")
        };
        let pct = 100.0 * done as f64 / total as f64;
        let mut err = std::io::stderr().lock();
        if finished {
            self.current = None;
            if self.tty {
                self.last_draw = None;
                let _ = write!(err, "\r\x1b[K");
            } else {
                let _ = writeln!(err, "k3-orch: {what} (100%) in {secs:.1} s");
            }
            let _ = err.flush();
            return;
        }
        if !self.tty {
            return;
        }
        // Redraw at most 10 times a second.
        if self
            .last_draw
            .is_some_and(|t| t.elapsed().as_millis() < 100)
        {
            return;
        }
        self.last_draw = Some(Instant::now());
        let eta = if done > 0 && secs > 0.0 {
            format!(", eta {:.0} s", secs / done as f64 * (total - done) as f64)
        } else {
            String::new()
        };
        let _ = write!(err, "\r\x1b[K{what} ({pct:.0}%{eta})");
        let _ = err.flush();
    }
}
