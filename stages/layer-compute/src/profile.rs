//! Opt-in wall-time profile of the forward pass by phase, for finding where a decode step
//! or a prompt's time goes (`K3_PROFILE=1` in the environment of the process that runs
//! the forward: the layer-compute stage, or k3-orch with `--single-process`).
//!
//! When enabled, every forward pass (a [`crate::Model::forward`] call, or each pass of
//! [`crate::Model::prefill_chunked`]) prints one line to stderr:
//! `k3 profile: ntok N total T ms | attn .. | router .. | ...`, the wall time spent in each
//! phase of that call, summed over layers, and `other` (the call's total minus the named
//! phases: norms, AttnRes mixes, residual adds, the embedding). Phases never overlap
//! (they are timed on the thread that runs the forward; products inside a phase run on
//! the compute pool), except `attn-core`, a part of `attn` printed after it and not
//! counted again in `other`: attention's own arithmetic (KDA's short convolutions and
//! recurrence, MLA's latent norms and attention over the cache), so that `attn` minus
//! `attn-core` is its matrix products. Disabled, a phase guard costs one relaxed atomic
//! load.
//!
//! Timing is observation only: nothing here changes a product, an order or a result.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::time::Instant;

/// A named phase of the forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// KDA or MLA attention (projections, recurrence or cache, output projection).
    Attn,
    /// The part of [`Phase::Attn`] that is not a matrix product (nested in it).
    AttnCore,
    /// The MoE router's product and the top-k choice.
    Router,
    /// The latent down-projection and the shared experts (gate/up and down).
    Shared,
    /// Routed experts' products (w1/w3, SiTU, w2) once their weights are at hand.
    Experts,
    /// Waiting for routed experts' weights (the fetcher; zero when resident).
    ExpertWait,
    /// The weighted combine, the latent norm and the latent up-projection.
    Combine,
    /// A dense FFN (gate/up and down).
    Dense,
    /// The final AttnRes mix, the norm and the lm_head.
    Head,
    /// Waiting for the trunk-loader to hand over a streamed layer or part (staged runs).
    TrunkWait,
}

impl Phase {
    const ALL: [Phase; 10] = [
        Phase::Attn,
        Phase::AttnCore,
        Phase::Router,
        Phase::Shared,
        Phase::Experts,
        Phase::ExpertWait,
        Phase::Combine,
        Phase::Dense,
        Phase::Head,
        Phase::TrunkWait,
    ];

    fn name(self) -> &'static str {
        match self {
            Phase::Attn => "attn",
            Phase::AttnCore => "attn-core",
            Phase::Router => "router",
            Phase::Shared => "shared",
            Phase::Experts => "experts",
            Phase::ExpertWait => "expert-wait",
            Phase::Combine => "combine",
            Phase::Dense => "dense-ffn",
            Phase::Head => "head",
            Phase::TrunkWait => "trunk-wait",
        }
    }
}

/// The number of phases.
#[doc(hidden)]
pub const N: usize = Phase::ALL.len();
static NANOS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
/// 0: not read yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Whether `K3_PROFILE` asks for the profile (read once per process).
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("K3_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0");
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        s => s == 2,
    }
}

/// Times one phase from its creation to its drop (nothing when the profile is off).
pub struct Span {
    phase: Phase,
    start: Option<Instant>,
}

/// Start timing `phase`.
pub fn span(phase: Phase) -> Span {
    Span {
        phase,
        start: enabled().then(Instant::now),
    }
}

impl Span {
    /// Stop now (same as dropping it).
    pub fn end(self) {}

    /// Move time out of this span into `phase` (e.g. the compute done inside a wait).
    pub fn exclude(&mut self, d: std::time::Duration) {
        if let Some(s) = self.start.as_mut() {
            *s += d;
        }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(s) = self.start {
            let ns = s.elapsed().as_nanos().min(u64::MAX as u128) as u64;
            NANOS[Phase::ALL
                .iter()
                .position(|&p| p == self.phase)
                .unwrap_or(0)]
            .fetch_add(ns, Ordering::Relaxed);
        }
    }
}

/// Start of a forward call: clears the counters and returns the call's start time (None
/// when the profile is off).
pub fn begin_call() -> Option<Instant> {
    if !enabled() {
        return None;
    }
    for n in &NANOS {
        n.store(0, Ordering::Relaxed);
    }
    Some(Instant::now())
}

/// End of a forward call: prints the line (see the module doc).
pub fn end_call(start: Option<Instant>, ntok: usize) {
    let Some(start) = start else { return };
    let total = start.elapsed().as_secs_f64() * 1e3;
    let ms: Vec<f64> = NANOS
        .iter()
        .map(|n| n.load(Ordering::Relaxed) as f64 / 1e6)
        .collect();
    eprintln!("{}", line(ntok, total, &ms));
}

/// The profile line of a call of `total` ms whose phases took `ms` (in [`Phase::ALL`]'s
/// order): `other` is the total minus the phases, `attn-core` not counted twice.
#[doc(hidden)]
pub fn line(ntok: usize, total: f64, ms: &[f64]) -> String {
    let mut named = 0.0;
    let mut line = format!("k3 profile: ntok {ntok} total {total:.1} ms");
    for (p, &ms) in Phase::ALL.iter().zip(ms) {
        if *p != Phase::AttnCore {
            named += ms;
        }
        line.push_str(&format!(" | {} {ms:.1}", p.name()));
    }
    line.push_str(&format!(" | other {:.1}", (total - named).max(0.0)));
    line
}
