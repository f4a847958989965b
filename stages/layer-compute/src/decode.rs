//! The ONE decode loop: `gen` tokens after a prompt, full recompute or incremental, with the
//! sampler. Every mode runs it: `--single-process` over mmapped shards, the staged pipeline
//! (this crate's `stage`, in processes or `--inproc` threads) over links, and the tests'
//! [`generate`]. What differs between them is only the [`Weights`] and the [`StepHooks`].

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::forward::{ForwardError, ForwardOutput, Model, Session};
use crate::sampler::{self, SamplerConfig};
use crate::weights::Weights;

/// What the loop needs to know.
pub struct LoopOptions<'a> {
    pub prompt: &'a [u32],
    pub gen: usize,
    /// Carry the session (prefill once, then one token per step); otherwise every step
    /// recomputes the whole prefix. Both give the same ids.
    pub incremental: bool,
    pub sampler: SamplerConfig,
    /// Generation ends after one of these ids (it is kept in the output).
    pub stop_ids: &'a [u32],
    /// Write the first step's logits row here (little-endian f32).
    pub dump_logits: Option<&'a Path>,
    /// Feed a prompt (and, recomputing, the whole prefix) in passes of at most this many
    /// tokens ([`Model::prefill_chunked`]); None: one pass. The same ids either way.
    pub prefill_chunk: Option<usize>,
}

/// One finished step.
pub struct Step<'a> {
    pub step: usize,
    pub token: u32,
    pub out: &'a ForwardOutput,
    /// Wall time of the step: forward plus sampling.
    pub seconds: f64,
}

/// Why the decode loop stopped before its end; `E` is the hooks' own error
/// ([`StepHooks::Error`]).
#[derive(Debug, thiserror::Error)]
pub enum DecodeError<E> {
    #[error("a kept session of {fed} tokens cannot continue a {prompt}-token prompt")]
    KeptTooLong { fed: usize, prompt: usize },
    #[error(
        "a session of {session} tokens cannot continue after {history} tokens with {to_feed} \
         more to feed{}",
        if *incremental { "" } else { " (continuing needs incremental decoding)" }
    )]
    Resume {
        session: usize,
        history: usize,
        to_feed: usize,
        incremental: bool,
    },
    #[error("forward pass failed at generation step {step}: {source}")]
    Forward {
        step: usize,
        #[source]
        source: ForwardError,
    },
    #[error("generation step {step}: {source}")]
    NonFinite {
        step: usize,
        #[source]
        source: NonFiniteLogits,
    },
    #[error("--dump-logits {}: {source}", path.display())]
    DumpLogits {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A hook failed (a staged run: a link or the control socket).
    #[error(transparent)]
    Hook(E),
}

/// What a mode does around each step. An error ends the loop with it
/// ([`DecodeError::Hook`]).
pub trait StepHooks {
    /// The hooks' own error (`std::convert::Infallible` for hooks that cannot fail).
    type Error: std::error::Error + 'static;
    /// Before the forward of `step`.
    fn before_step(&mut self, _step: usize) {}
    /// Right after the forward of `step`, whatever its result (a staged run reports a link
    /// failure here, which is the cause of any forward error that follows).
    fn after_forward(&mut self, _step: usize) -> Result<(), Self::Error> {
        Ok(())
    }
    /// A prompt fed in several passes: `done` of its `total` tokens are in (after each
    /// pass).
    fn prefill_pass(&mut self, _done: usize, _total: usize) {}
    /// The step's token is chosen.
    fn on_step(&mut self, s: Step<'_>) -> Result<(), Self::Error>;
    /// Asked after each step: true ends generation there (a stop string was decoded, the
    /// client went away). The ids so far are the result.
    fn done(&mut self) -> bool {
        false
    }
}

/// Decode `o.gen` tokens after `o.prompt`; returns the generated ids.
pub fn decode_loop<W: Weights, H: StepHooks>(
    model: &Model<W>,
    o: &LoopOptions<'_>,
    hooks: &mut H,
) -> Result<Vec<u32>, DecodeError<H::Error>> {
    let mut sess = model.new_session();
    decode_session(model, &mut sess, 0, o, hooks)
}

/// [`decode_loop`] on a session that has already consumed the first `fed` prompt tokens
/// (a kept prefix state; incremental only, `fed < o.prompt.len()`). Afterwards `sess` has
/// consumed the prompt and every generated id but the last (which is what a follow-up
/// request extends).
pub fn decode_session<W: Weights, H: StepHooks>(
    model: &Model<W>,
    sess: &mut Session,
    fed: usize,
    o: &LoopOptions<'_>,
    hooks: &mut H,
) -> Result<Vec<u32>, DecodeError<H::Error>> {
    if fed > o.prompt.len() || (fed > 0 && fed == o.prompt.len()) {
        return Err(DecodeError::KeptTooLong {
            fed,
            prompt: o.prompt.len(),
        });
    }
    let rest = LoopOptions {
        prompt: &o.prompt[fed..],
        gen: o.gen,
        incremental: o.incremental,
        sampler: o.sampler,
        stop_ids: o.stop_ids,
        dump_logits: o.dump_logits,
        prefill_chunk: o.prefill_chunk,
    };
    decode_resumed(
        model,
        sess,
        &Resume {
            history: &o.prompt[..fed],
            first_step: 0,
        },
        &rest,
        hooks,
    )
}

/// Where a resumed generation picks up.
pub struct Resume<'a> {
    /// The tokens `sess` has consumed (the repetition penalty looks at them too).
    pub history: &'a [u32],
    /// The sampler's step number of this loop's first step (a seeded run continued from a
    /// saved state draws what the uninterrupted run drew).
    pub first_step: usize,
}

/// The one decode loop on a session that has consumed `r.history`: `o.prompt` holds the
/// tokens still to feed (at least one when there is a history). With an empty history and
/// `first_step` 0 this is [`decode_loop`].
pub fn decode_resumed<W: Weights, H: StepHooks>(
    model: &Model<W>,
    sess: &mut Session,
    r: &Resume<'_>,
    o: &LoopOptions<'_>,
    hooks: &mut H,
) -> Result<Vec<u32>, DecodeError<H::Error>> {
    if sess.len() != r.history.len()
        || (!r.history.is_empty() && (!o.incremental || o.prompt.is_empty()))
    {
        return Err(DecodeError::Resume {
            session: sess.len(),
            history: r.history.len(),
            to_feed: o.prompt.len(),
            incremental: o.incremental,
        });
    }
    let vocab = model.vocab();
    let mut seq = r.history.to_vec();
    seq.extend_from_slice(o.prompt);
    let mut generated = Vec::with_capacity(o.gen);
    for step in 0..o.gen {
        hooks.before_step(step);
        let t0 = Instant::now();
        let res: Result<ForwardOutput, ForwardError> = if o.incremental {
            if step == 0 {
                let total = o.prompt.len();
                model.prefill_passes(sess, o.prompt, o.prefill_chunk, &mut |done| {
                    hooks.prefill_pass(done, total)
                })
            } else {
                model.step(sess, *seq.last().expect("non-empty sequence"))
            }
        } else {
            let mut s = model.new_session();
            model.prefill_chunked(&mut s, &seq, o.prefill_chunk)
        };
        hooks.after_forward(step).map_err(DecodeError::Hook)?;
        let out = res.map_err(|source| DecodeError::Forward { step, source })?;
        let row = &out.logits[(out.rows - 1) * vocab..out.rows * vocab];
        check_finite(row).map_err(|source| DecodeError::NonFinite { step, source })?;
        let step_no = (r.first_step + step) as u64;
        let token = sampler::sample(row, &o.sampler, step_no, &seq, &generated) as u32;
        if step == 0 {
            if let Some(p) = o.dump_logits {
                let bytes: Vec<u8> = row.iter().flat_map(|x| x.to_le_bytes()).collect();
                k3_io::output::write_atomic(p, &bytes).map_err(|source| {
                    DecodeError::DumpLogits {
                        path: p.to_path_buf(),
                        source,
                    }
                })?;
            }
        }
        hooks
            .on_step(Step {
                step,
                token,
                out: &out,
                seconds: t0.elapsed().as_secs_f64(),
            })
            .map_err(DecodeError::Hook)?;
        generated.push(token);
        seq.push(token);
        if o.stop_ids.contains(&token) || hooks.done() {
            break;
        }
    }
    Ok(generated)
}

/// Session states kept after requests, keyed by the tokens each has consumed, most
/// recently used last (prefix reuse in `serve` and `chat`: a prompt that extends a kept key
/// prefills only the rest). Bounded twice: at most `cap` entries, and at most `byte_cap`
/// bytes of states (each kept state gives back its unused KV room first, and counts what
/// it still allocates); the least recently used entries go first.
pub struct PrefixCache {
    entries: Vec<(Vec<u32>, Session)>,
    /// Entries kept (0: no reuse).
    pub cap: usize,
    /// Bytes of kept states, at most (`usize::MAX`: only the count bounds them).
    pub byte_cap: usize,
}

impl PrefixCache {
    /// At most `cap` entries, whatever their bytes.
    pub fn new(cap: usize) -> PrefixCache {
        PrefixCache::with_bytes(cap, usize::MAX)
    }

    /// At most `cap` entries and `byte_cap` bytes of states.
    pub fn with_bytes(cap: usize, byte_cap: usize) -> PrefixCache {
        PrefixCache {
            entries: Vec::new(),
            cap,
            byte_cap,
        }
    }

    /// Entries kept now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes the kept states allocate now.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|(_, s)| s.allocated_bytes()).sum()
    }

    /// The longest kept key that is a proper prefix of `prompt` (at least one token left
    /// to feed): its length and a clone of its state.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(usize, Session)> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, (k, _))| k.len() < prompt.len() && prompt.starts_with(k))
            .max_by_key(|(_, (k, _))| k.len())
            .map(|(i, _)| i)?;
        let e = self.entries.remove(best);
        let out = (e.0.len(), e.1.clone());
        self.entries.push(e);
        Some(out)
    }

    /// Keep `s` under `key` (the tokens it consumed), dropping the least recently used
    /// entries beyond the count and the bytes (a state larger than `byte_cap` on its own
    /// is not kept).
    pub fn insert(&mut self, key: Vec<u32>, mut s: Session) {
        if self.cap == 0 || key.is_empty() || s.len() != key.len() {
            return;
        }
        s.shrink_to_fit();
        if s.allocated_bytes() > self.byte_cap {
            return;
        }
        self.entries.retain(|(k, _)| *k != key);
        self.entries.push((key, s));
        while self.entries.len() > self.cap || self.bytes() > self.byte_cap {
            self.entries.remove(0);
        }
    }

    /// Drop every entry.
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

/// A logits row holding NaN or ±Inf ([`check_finite`]): its first bad entry, and how many
/// of its entries are bad.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error(
    "the logits are not finite (logit {index} is {value}, {bad} of {len} entries bad); no \
     token is chosen from them"
)]
pub struct NonFiniteLogits {
    pub index: usize,
    pub value: f32,
    pub bad: usize,
    pub len: usize,
}

/// Refuse a logits row holding NaN or ±Inf: a token chosen from it would be noise (argmax
/// of NaN is index 0), so the run ends instead, naming the first bad entry.
pub fn check_finite(row: &[f32]) -> Result<(), NonFiniteLogits> {
    match row.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(index) => Err(NonFiniteLogits {
            index,
            value: row[index],
            bad: row.iter().filter(|x| !x.is_finite()).count(),
            len: row.len(),
        }),
    }
}

/// Statistics of one generation step.
#[derive(Clone, Debug, PartialEq)]
pub struct GenStep {
    pub token: u32,
    pub seconds: f64,
    pub expert_requests: usize,
    pub expert_failures: usize,
}

/// Result of [`generate`].
#[derive(Clone, Debug, Default)]
pub struct Generation {
    /// The generated ids (not including the prompt).
    pub ids: Vec<u32>,
    /// Logits of the first step (the prediction after the last prompt token).
    pub first_logits: Vec<f32>,
    pub steps: Vec<GenStep>,
    /// Failure messages of every step (empty in a sound run).
    pub failure_msgs: Vec<String>,
}

impl StepHooks for Generation {
    type Error = std::convert::Infallible;

    fn on_step(&mut self, s: Step<'_>) -> Result<(), Self::Error> {
        if s.step == 0 {
            self.first_logits = s.out.logits.clone();
        }
        self.steps.push(GenStep {
            token: s.token,
            seconds: s.seconds,
            expert_requests: s.out.stats.expert_requests,
            expert_failures: s.out.stats.expert_failures,
        });
        self.failure_msgs
            .extend(s.out.stats.failure_msgs.iter().cloned());
        Ok(())
    }
}

/// Greedy decode of `n` tokens after `prompt` through [`decode_loop`] (no stop ids), with
/// every step's statistics and the first step's logits.
pub fn generate<W: Weights>(
    model: &Model<W>,
    prompt: &[u32],
    n: usize,
    incremental: bool,
) -> Result<Generation, DecodeError<std::convert::Infallible>> {
    let mut g = Generation::default();
    g.ids = decode_loop(
        model,
        &LoopOptions {
            prompt,
            gen: n,
            incremental,
            sampler: SamplerConfig::default(),
            stop_ids: &[],
            dump_logits: None,
            prefill_chunk: None,
        },
        &mut g,
    )?;
    Ok(g)
}
