//! The generation engine behind `serve`, `chat` and `k3-orch MODEL --prompts F.jsonl`: one
//! worker thread that owns the model (loaded once) and runs every request it holds
//! together, continuous batching (issue 33): up to `slots` requests decode together, one
//! row each per forward pass, a new request joins at the next pass boundary, prompts are
//! fed in chunks interleaved with the others' decode steps, and a request that finishes,
//! meets a stop string or id, or whose client goes away frees its slot at once. Requests
//! beyond the slots wait in a queue of at most `max_queue` (the HTTP side answers 429 past
//! it).
//!
//! Two backends, with the same scheduler ([`k3_layer_compute::batch::Scheduler`]) and
//! sampler as every other mode, so each request gives the ids (and logits) it gives alone,
//! whatever runs beside it, and the ids `k3-orch DIR --incremental` gives for its prompt:
//! - **warm stages** (the default): the product's pipeline, the four stage processes each in
//!   its own cgroup, started once and kept up ([`crate::supervise::warm`]); the trunk is
//!   loaded once and layer-compute runs the scheduler. A stage that dies fails every request
//!   in flight (an error naming the stage and the cause) and the stages are started again
//!   for the next ones. `/metrics` reads each stage's cgroup.
//! - **`--single-process`**: the scheduler over the memory-mapped shards in this process.
//!
//! Prefix reuse: each finished request's session state (MLA KV cache, KDA recurrent state
//! and conv tails) is kept, keyed by the tokens it has consumed, and so is the state at the
//! end of the prompt's last complete chat message (`snapshot_at`); a later prompt that
//! starts with a kept key takes a clone of it into its slot and prefills only the rest
//! (`cached_tokens`). The kept states are bounded in count (`--cache-entries`) and bytes
//! (the memory plan's prefix-cache line).
//!
//! Saved sessions (`k3-orch chat`'s `/save` and `/load`): [`Engine::save_state`] writes the
//! kept state for a conversation to a state file (`k3_layer_compute::state`, the
//! `--save-state` format, with this model's fingerprint) and [`Engine::load_state`] puts one
//! back in the prefix cache; with warm stages layer-compute does both (`SaveState` /
//! `LoadState` on its control socket). They run on the worker when no request is in flight,
//! in order.
//!
//! Bounds: at most `slots + max_queue` requests are held (the caller checks
//! [`Engine::try_submit`]'s refusal); each request's events are at most its `max_tokens`
//! text pieces plus three; a state operation waits only while requests are in flight.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use k3_layer_compute::batch::{self, Scheduler, SchedulerOptions};
use k3_layer_compute::forward::{Model, ModelOptions};
use k3_layer_compute::weights::SourceWeights;
use k3_model::config::ModelConfig;
use k3_model::mmap_weights::MmapWeights;
use k3_protocol::conf::SamplerConfig;
use k3_protocol::messages::PassStats;
use k3_tokenizer::Tokenizer;

use super::api::{Prepared, TokenLogprobs};
use super::metrics::{Histogram, Rate, ITL_BUCKETS, ROWS_BUCKETS, TPS_BUCKETS, TTFT_BUCKETS};
use crate::run::stream::TextStream;
use crate::supervise::warm::{StageMemory, Warm, WarmEvent, WarmRequest};
use crate::supervise::Launch;

type Weights = SourceWeights<MmapWeights>;

/// One generation request, already tokenized.
pub struct Job {
    pub prompt: Vec<u32>,
    /// Keep a prefix-cache entry after this many prompt tokens too (the end of the last
    /// complete chat message), when it is shorter than the prompt.
    pub snapshot_at: Option<usize>,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// Keep every step's logits row ([`Done::logits`]; the debug endpoint).
    pub keep_logits: bool,
    /// Text only (`chat`'s replies): the special ids [`HiddenIds`] names add nothing to
    /// the text (they still count as tokens).
    pub text_only: bool,
    /// Send each generated id's log-probability and this many top alternatives here, before
    /// its `Text` (OpenAI's `logprobs`); the stop id that ends a reply has none.
    pub logprobs: Option<(usize, tokio::sync::mpsc::UnboundedSender<TokenLogprobs>)>,
    /// Set by the caller to end the job early (client gone, server draining).
    pub cancel: Arc<AtomicBool>,
    /// When the request arrived (its time to first token counts from here).
    pub arrived: Instant,
    pub events: tokio::sync::mpsc::UnboundedSender<Event>,
}

impl Job {
    /// The job of a validated request; its cancel flag and where its events go.
    pub fn new(
        p: &Prepared,
        cancel: Arc<AtomicBool>,
        events: tokio::sync::mpsc::UnboundedSender<Event>,
    ) -> Job {
        Job {
            prompt: p.prompt.clone(),
            snapshot_at: p.snapshot_at,
            max_tokens: p.max_tokens,
            sampler: p.sampler,
            stop: p.stop.clone(),
            keep_logits: p.keep_logits,
            text_only: false,
            logprobs: None,
            cancel,
            arrived: Instant::now(),
            events,
        }
    }
}

/// Why generation ended (OpenAI's `finish_reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    Cancelled,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Cancelled => "cancelled",
        }
    }
}

/// What a job reports, in order: `Started`, any number of `Text`, then `Done` or `Error`.
#[derive(Debug)]
pub enum Event {
    Started { cached_tokens: usize },
    Text(String),
    Done(Done),
    Error(String),
}

#[derive(Clone, Debug)]
pub struct Done {
    pub finish: Finish,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub ids: Vec<u32>,
    /// Each id's logits row, when the job asked ([`Job::keep_logits`]).
    pub logits: Vec<Vec<f32>>,
    /// Seconds from the first token to the last.
    pub seconds: f64,
    /// Seconds from taking a slot to the first token (the prompt's prefill).
    pub prefill_seconds: f64,
}

/// Counters, gauges and histograms for `/metrics`.
pub struct Stats {
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub expert_requests: AtomicU64,
    /// Requests the engine holds: waiting for a slot or in one (the HTTP side's bound).
    pub queue: AtomicUsize,
    /// Of which waiting for a slot.
    pub waiting: AtomicUsize,
    /// Of which in a slot.
    pub busy: AtomicUsize,
    /// Routed-expert lookups served from experts already resident.
    pub resident_hits: AtomicU64,
    /// Forward passes run.
    pub passes: AtomicU64,
    /// Times the stages were started again after a fault.
    pub restarts: AtomicU64,
    /// Rows per forward pass; time to first token; time between tokens; each request's
    /// decode speed.
    pub rows: Histogram,
    /// Decode rows per forward pass (requests decoding together).
    pub decode_rows: Histogram,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub request_tps: Histogram,
    /// Tokens per second over every request, the last few seconds.
    pub rate: Rate,
    /// Per-stage memory of the warm stages (empty for `--single-process`).
    pub stages: Mutex<Vec<StageMemory>>,
    pub ready: AtomicBool,
    /// Set while shutting down past the drain grace period: running jobs end now.
    pub abort: AtomicBool,
    /// Set at the shutdown deadline: the stages are not started again, queued jobs fail.
    pub closing: AtomicBool,
    /// Stops the current warm stages from another thread ([`Engine::stop_stages_now`]).
    pub stopper: Mutex<Option<crate::supervise::warm::Stopper>>,
    pub load_error: Mutex<Option<String>>,
    /// Log one line per request when it ends (`serve` sets it; `chat` has `/stats`).
    pub log_requests: AtomicBool,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            requests: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            expert_requests: AtomicU64::new(0),
            queue: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            busy: AtomicUsize::new(0),
            resident_hits: AtomicU64::new(0),
            passes: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            rows: Histogram::new(ROWS_BUCKETS),
            decode_rows: Histogram::new(ROWS_BUCKETS),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            request_tps: Histogram::new(TPS_BUCKETS),
            rate: Rate::default(),
            stages: Mutex::new(Vec::new()),
            ready: AtomicBool::new(false),
            abort: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            stopper: Mutex::new(None),
            load_error: Mutex::new(None),
            log_requests: AtomicBool::new(false),
        }
    }
}

/// A session-state operation for the worker (`chat`'s `/save` and `/load`).
pub enum StateOp {
    /// Write the state kept for the longest proper prefix of `conversation` to `path`.
    Save {
        path: std::path::PathBuf,
        conversation: Vec<u32>,
    },
    /// Read the state file at `path` (its tokens must start `conversation`) into the cache.
    Load {
        path: std::path::PathBuf,
        conversation: Vec<u32>,
    },
}

/// What the worker is sent: a job, or a state operation with where to answer it.
enum Work {
    Job(Job),
    State(StateOp, mpsc::Sender<Result<usize, EngineError>>),
}

/// How many requests run at once, and the engine's other bounds.
#[derive(Clone, Copy, Debug)]
pub struct SlotOptions {
    /// Requests decoding together.
    pub slots: usize,
    /// Requests waiting for a slot, at most.
    pub max_queue: usize,
    /// Prompt tokens per pass over every slot still prefilling.
    pub prefill_chunk: usize,
    /// Prompt plus generated tokens of one request, at most.
    pub ctx: usize,
    /// Bytes of kept session states, at most.
    pub prefix_bytes: u64,
}

/// How to load the engine.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub model_dir: std::path::PathBuf,
    pub config_path: std::path::PathBuf,
    /// None: ids in, ids out (a byte vocabulary for text, as the tokenizer stage's).
    pub tok_dir: Option<std::path::PathBuf>,
    pub threads: usize,
    pub layers: Option<usize>,
    /// Prefix-cache entries kept (0: no reuse).
    pub cache_entries: usize,
    pub slots: SlotOptions,
    /// The warm pipeline to run (None: `--single-process`).
    pub warm: Option<Launch>,
}

/// Why [`Engine::try_submit`] did not take a job.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// Every slot is busy and the queue is full.
    #[error("the queue is full ({0} requests wait for a slot); retry later")]
    QueueFull(usize),
    /// The worker has stopped.
    #[error("the engine has stopped")]
    Stopped,
}

/// Why the engine could not start, or a session-state operation (`chat`'s `/save` and
/// `/load`) failed. The messages are the ones `serve` and `chat` print.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("--tok {}: {source}", dir.display())]
    Tokenizer {
        dir: std::path::PathBuf,
        #[source]
        source: k3_tokenizer::TokError,
    },
    #[error(transparent)]
    Config(#[from] k3_model::config::ConfigError),
    #[error("the tokenizer has {tok} ids but the model's vocabulary is {vocab}")]
    VocabMismatch { tok: u32, vocab: usize },
    #[error("cannot start the engine thread: {0}")]
    Thread(#[source] std::io::Error),
    /// A file the operation names could not be resolved or written.
    #[error("{}: {source}", path.display())]
    File {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("model fingerprint: {0}")]
    Fingerprint(#[source] k3_layer_compute::state::StateError),
    /// A state file that cannot be read (its path and why, without the flag's name).
    #[error("{}", .0.without_flag())]
    StateFile(#[source] k3_layer_compute::state::StateError),
    /// A state that cannot be encoded or used.
    #[error(transparent)]
    State(#[from] k3_layer_compute::state::StateError),
    /// The state refused by the layer-compute stage.
    #[error(transparent)]
    Stage(#[from] crate::supervise::warm::StateRefused),
    /// The stages failed during the operation and were restarted.
    #[error("{0}; the stages were restarted")]
    Restarted(String),
    /// The stages are down and could not be started again.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The warm stages could not be started (the pipeline's message).
    #[error("{}", .0.msg.trim_start_matches("k3-orch: "))]
    Start(crate::error::RunError),
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The model failed to load (the message `/health` shows).
    #[error("{0}")]
    Load(String),
    #[error("engine lock poisoned")]
    Poisoned,
    #[error("the engine has stopped")]
    Stopped,
    #[error("the engine stopped")]
    NoAnswer,
}

/// Handle to the worker thread.
pub struct Engine {
    jobs: Mutex<mpsc::Sender<Work>>,
    pub stats: Arc<Stats>,
    pub tok: Option<Arc<Tokenizer>>,
    pub vocab: usize,
    pub model_name: String,
    pub slots: SlotOptions,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Engine {
    /// Load the tokenizer now; start the worker, which loads the model (`stats.ready` turns
    /// true when it is done; a load failure is kept in `stats.load_error`).
    pub fn start(o: EngineOptions) -> Result<Engine, EngineError> {
        let tok = match &o.tok_dir {
            Some(d) => Some(Arc::new(Tokenizer::from_dir(d).map_err(|source| {
                EngineError::Tokenizer {
                    dir: d.clone(),
                    source,
                }
            })?)),
            None => None,
        };
        let cfg = ModelConfig::load(&o.config_path)?;
        if let Some(t) = &tok {
            if (t.n_vocab() as usize) > cfg.vocab_size {
                return Err(EngineError::VocabMismatch {
                    tok: t.n_vocab(),
                    vocab: cfg.vocab_size,
                });
            }
        }
        let vocab = cfg.vocab_size;
        let stats = Arc::new(Stats::default());
        let (tx, rx) = mpsc::channel::<Work>();
        let st = stats.clone();
        let tk = tok.clone();
        let slots = o.slots;
        let worker = std::thread::Builder::new()
            .name("k3-engine".into())
            .spawn(move || match o.warm.clone() {
                Some(l) => warm_worker(&o, l, tk, rx, st),
                None => inproc_worker(o, cfg, tk, rx, st),
            })
            .map_err(EngineError::Thread)?;
        Ok(Engine {
            jobs: Mutex::new(tx),
            stats,
            tok,
            vocab,
            model_name: "k3".to_string(),
            slots,
            worker: Mutex::new(Some(worker)),
        })
    }

    /// Hand a job over unless the engine already holds `slots + max_queue` (then it is
    /// refused, as the HTTP side's 429).
    pub fn try_submit(&self, job: Job) -> Result<(), Refusal> {
        let st = &self.stats;
        let cap = self.slots.slots + self.slots.max_queue;
        let before = st.queue.fetch_add(1, Ordering::SeqCst);
        if before >= cap {
            st.queue.fetch_sub(1, Ordering::SeqCst);
            return Err(Refusal::QueueFull(self.slots.max_queue));
        }
        st.requests.fetch_add(1, Ordering::Relaxed);
        let sent = self
            .jobs
            .lock()
            .map_err(|_| Refusal::Stopped)
            .and_then(|j| j.send(Work::Job(job)).map_err(|_| Refusal::Stopped));
        if sent.is_err() {
            st.queue.fetch_sub(1, Ordering::SeqCst);
        }
        sent
    }

    /// Write the session state kept for `conversation` (the tokens of the conversation so
    /// far, as the next turn's prompt starts) to the state file `path`; how many tokens it
    /// holds. Runs after the jobs handed over before it.
    pub fn save_state(
        &self,
        path: &std::path::Path,
        conversation: &[u32],
    ) -> Result<usize, EngineError> {
        self.state_op(StateOp::Save {
            path: absolute(path)?,
            conversation: conversation.to_vec(),
        })
    }

    /// Read the state file `path` (saved by [`Engine::save_state`] for this model, its tokens
    /// a prefix of `conversation`) back into the prefix cache; how many tokens it holds.
    pub fn load_state(
        &self,
        path: &std::path::Path,
        conversation: &[u32],
    ) -> Result<usize, EngineError> {
        self.state_op(StateOp::Load {
            path: absolute(path)?,
            conversation: conversation.to_vec(),
        })
    }

    fn state_op(&self, op: StateOp) -> Result<usize, EngineError> {
        let (tx, rx) = mpsc::channel();
        self.jobs
            .lock()
            .map_err(|_| EngineError::Poisoned)?
            .send(Work::State(op, tx))
            .map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::NoAnswer)?
    }

    /// Wait until the model is loaded or failed to load.
    pub fn wait_ready(&self) -> Result<(), EngineError> {
        loop {
            if self.stats.ready.load(Ordering::SeqCst) {
                return Ok(());
            }
            if let Some(e) = self.stats.load_error.lock().ok().and_then(|g| g.clone()) {
                return Err(EngineError::Load(e));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The shutdown deadline: no restart from now on, and the warm stages are killed and
    /// reaped and their cgroups removed now, from this thread, whatever the worker is doing
    /// (a stage that does not answer cannot hold the exit up). The jobs in flight fail.
    pub fn stop_stages_now(&self) {
        self.stats.closing.store(true, Ordering::SeqCst);
        self.stats.abort.store(true, Ordering::SeqCst);
        if let Ok(g) = self.stats.stopper.lock() {
            if let Some(s) = g.as_ref() {
                s.stop_now();
            }
        }
    }

    /// Stop taking jobs and wait for the worker to finish the ones it holds.
    pub fn shutdown(&self) {
        if let Ok(mut j) = self.jobs.lock() {
            let (dead, _) = mpsc::channel();
            *j = dead;
        }
        if let Some(h) = self.worker.lock().ok().and_then(|mut w| w.take()) {
            let _ = h.join();
        }
    }
}

/// `path` made absolute (a warm stage may not share this process's working directory).
fn absolute(path: &std::path::Path) -> Result<std::path::PathBuf, EngineError> {
    std::path::absolute(path).map_err(|source| EngineError::File {
        path: path.to_path_buf(),
        source,
    })
}

/// The model's fingerprint for state files, as `--save-state` computes it.
fn state_fingerprint(o: &EngineOptions) -> Result<String, EngineError> {
    let cfg = ModelConfig::load(&o.config_path)?;
    let layers = o
        .layers
        .unwrap_or(cfg.num_hidden_layers)
        .min(cfg.num_hidden_layers);
    k3_layer_compute::state::fingerprint(&o.config_path, &o.model_dir, layers)
        .map_err(EngineError::Fingerprint)
}

/// The bytes of a generated id: the tokenizer's, or (without one) the byte vocabulary the
/// tokenizer stage uses then (id = byte).
pub(crate) fn id_bytes(tok: Option<&Tokenizer>, id: u32) -> Vec<u8> {
    match tok {
        Some(t) => t
            .token_bytes(id)
            .map(<[u8]>::to_vec)
            .unwrap_or_else(|_| format!("<|bad_id_{id}|>").into_bytes()),
        None if id < 256 => vec![id as u8],
        None => format!("<|{id}|>").into_bytes(),
    }
}

/// The ids whose text a text-only job ([`Job::text_only`], `chat`'s replies) does not get:
/// the tokenizer's special ids, except the chat format's structure (`<|open|>`,
/// `<|close|>`, `<|sep|>`, `<|end_of_msg|>`), which its reader parses away
/// ([`k3_tokenizer::OutputStream`]), so no control token is ever printed, as llama.cpp's
/// chat shows none. Without a tokenizer nothing is hidden.
#[derive(Clone, Debug, Default)]
pub struct HiddenIds {
    specials: std::ops::Range<u32>,
    structure: Vec<u32>,
}

impl HiddenIds {
    pub fn of(tok: Option<&Tokenizer>) -> HiddenIds {
        use k3_tokenizer::chat::{CLOSE, END_OF_MSG, OPEN, SEP};
        let Some(t) = tok else {
            return HiddenIds::default();
        };
        HiddenIds {
            specials: t.n_ranks()..t.n_vocab(),
            structure: [OPEN, CLOSE, SEP, END_OF_MSG]
                .iter()
                .filter_map(|n| t.special_id(n))
                .collect(),
        }
    }

    /// The bytes of `id` a text-only job gets: none for a hidden special.
    pub fn shown<'a>(&self, id: u32, bytes: &'a [u8]) -> &'a [u8] {
        if self.specials.contains(&id) && !self.structure.contains(&id) {
            &[]
        } else {
            bytes
        }
    }
}

/// What the worker loop needs from a backend: hand requests over, stop them, and learn
/// what happened, in order.
trait Backend {
    /// Hand a request over; its number in the events.
    fn submit(&mut self, q: &WarmRequest) -> Result<u64, BackendError>;
    /// End a request at the next pass boundary (its `Done` follows).
    fn stop(&mut self, id: u64) -> Result<(), BackendError>;
    /// Run a pass (in process) or wait up to `wait` for reports (stages).
    fn events(&mut self, wait: Duration) -> Result<Vec<WarmEvent>, BackendError>;
    /// Save or load a session state (no request in flight).
    fn state(&mut self, op: &StateOp) -> Result<usize, EngineError>;
    /// Between requests: notice a fault (and recover from it).
    fn idle(&mut self) {}
    /// After a fault that lost every request in flight: start again (the stages).
    fn restart(&mut self, _why: &str) {}
}

/// A backend failure.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The pipeline failed (a stage died, failed or fell silent): every request in flight
    /// is lost and the stages are restarted.
    #[error("{0}")]
    Fault(String),
    /// This one request cannot run (the others are not touched).
    #[error("{0}")]
    Refused(String),
}

/// A job the worker holds, with what it has produced so far.
struct Live {
    job: Job,
    text: TextStream,
    ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    finish: Finish,
    cached: usize,
    started: bool,
    /// The job's answer went out (done, failed, cancelled): the rest of what the backend
    /// reports for it is ignored; it stays until the backend says it ended.
    answered: bool,
    /// The backend was told to stop it.
    stopping: bool,
    /// When it took a slot (its prefill began).
    started_at: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

/// The worker loop over a backend: take jobs and state operations, hand jobs over, stop
/// the cancelled ones, and turn the backend's reports into each job's events.
struct Driver<'a> {
    stats: &'a Stats,
    stop_ids: Vec<u32>,
    /// What text-only jobs do not show.
    hidden: HiddenIds,
    cache_entries: usize,
    live: HashMap<u64, Live>,
    /// State operations that wait for the requests in flight to end.
    held_ops: VecDeque<(StateOp, mpsc::Sender<Result<usize, EngineError>>)>,
}

impl Driver<'_> {
    fn run(&mut self, b: &mut dyn Backend, rx: &mpsc::Receiver<Work>) {
        loop {
            // Idle: wait for work (and look after the stages meanwhile).
            if self.live.is_empty() {
                while let Some((op, answer)) = self.held_ops.pop_front() {
                    let _ = answer.send(b.state(&op));
                }
                match rx.recv_timeout(Duration::from_millis(500)) {
                    Ok(w) => self.take(b, w),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        b.idle();
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(w) = rx.try_recv() {
                self.take(b, w);
            }
            if let Err(e) = self.stop_cancelled(b) {
                self.fault(b, &e);
                continue;
            }
            if self.live.is_empty() {
                continue;
            }
            match b.events(Duration::from_millis(20)) {
                Ok(evs) => {
                    for ev in evs {
                        if let Err(e) = self.report(b, ev) {
                            self.fault(b, &e);
                            break;
                        }
                    }
                }
                Err(e) => self.fault(b, &e),
            }
        }
    }

    /// A job or a state operation from a caller.
    fn take(&mut self, b: &mut dyn Backend, w: Work) {
        match w {
            Work::State(op, answer) => {
                if self.live.is_empty() {
                    let _ = answer.send(b.state(&op));
                } else {
                    self.held_ops.push_back((op, answer));
                }
            }
            Work::Job(job) if self.stats.closing.load(Ordering::SeqCst) => {
                answer_error(&job, "the server is shutting down", self.stats);
                self.stats.queue.fetch_sub(1, Ordering::SeqCst);
            }
            Work::Job(job) => {
                let q = WarmRequest {
                    prompt: job.prompt.clone(),
                    gen: job.max_tokens,
                    sampler: job.sampler,
                    stop_ids: self.stop_ids.clone(),
                    snapshot_at: job.snapshot_at,
                    cache_entries: self.cache_entries,
                    keep_logits: job.keep_logits || job.logprobs.is_some(),
                };
                match b.submit(&q) {
                    Ok(id) => {
                        self.stats.waiting.fetch_add(1, Ordering::SeqCst);
                        self.live.insert(
                            id,
                            Live {
                                text: TextStream::new(&job.stop),
                                job,
                                ids: Vec::new(),
                                logits: Vec::new(),
                                finish: Finish::Length,
                                cached: 0,
                                started: false,
                                answered: false,
                                stopping: false,
                                started_at: None,
                                first_token: None,
                                last_token: None,
                            },
                        );
                    }
                    Err(e) => {
                        answer_error(&job, &e.to_string(), self.stats);
                        self.stats.queue.fetch_sub(1, Ordering::SeqCst);
                        if let BackendError::Fault(why) = e {
                            self.fault(b, &BackendError::Fault(why));
                        }
                    }
                }
            }
        }
    }

    /// Tell the backend to stop every job whose client went away (or that the shutdown
    /// cuts).
    fn stop_cancelled(&mut self, b: &mut dyn Backend) -> Result<(), BackendError> {
        let abort = self.stats.abort.load(Ordering::Relaxed);
        for (id, l) in self.live.iter_mut() {
            if !l.stopping && (abort || l.job.cancel.load(Ordering::Relaxed)) {
                l.stopping = true;
                if !l.answered {
                    l.finish = Finish::Cancelled;
                }
                b.stop(*id)?;
            }
        }
        Ok(())
    }

    /// End job `id`'s answer with `finish` and stop it at the backend.
    fn end(&mut self, b: &mut dyn Backend, id: u64, finish: Finish) -> Result<(), BackendError> {
        let Some(l) = self.live.get_mut(&id) else {
            return Ok(());
        };
        l.finish = finish;
        answer_done(l, id, self.stats);
        if !l.stopping {
            l.stopping = true;
            b.stop(id)?;
        }
        Ok(())
    }

    /// One report of the backend.
    fn report(&mut self, b: &mut dyn Backend, ev: WarmEvent) -> Result<(), BackendError> {
        let stats = self.stats;
        match ev {
            WarmEvent::Started { req, cached_tokens } => {
                if let Some(l) = self.live.get_mut(&req) {
                    l.started = true;
                    l.started_at = Some(Instant::now());
                    l.cached = cached_tokens;
                    stats.waiting.fetch_sub(1, Ordering::SeqCst);
                    stats.busy.fetch_add(1, Ordering::SeqCst);
                    if !l.answered {
                        let _ = l.job.events.send(Event::Started { cached_tokens });
                    }
                }
            }
            WarmEvent::Token {
                req,
                index,
                token,
                bytes,
                expert_failures,
                logits,
            } => {
                let Some(l) = self.live.get_mut(&req) else {
                    return Ok(());
                };
                if l.answered {
                    return Ok(());
                }
                let now = Instant::now();
                match l.last_token {
                    None => stats
                        .ttft
                        .observe(now.duration_since(l.job.arrived).as_secs_f64()),
                    Some(t) => stats.itl.observe(now.duration_since(t).as_secs_f64()),
                }
                l.first_token.get_or_insert(now);
                l.last_token = Some(now);
                stats.rate.add(1);
                if expert_failures > 0 {
                    // The request ends rather than answer with text computed without them.
                    let msg = format!(
                        "{expert_failures} routed expert(s) failed to load at generation step \
                         {index} (see the server log): the request ends rather than answer \
                         with text computed without them"
                    );
                    log_end(l, req, &format!("error ({msg})"), stats);
                    answer_error(&l.job, &msg, stats);
                    l.answered = true;
                    if !l.stopping {
                        l.stopping = true;
                        b.stop(req)?;
                    }
                    return Ok(());
                }
                l.ids.push(token);
                let stop = self.stop_ids.contains(&token);
                if let Some(row) = logits {
                    if let (Some((k, tx)), false) = (&l.job.logprobs, stop) {
                        let _ = tx.send(super::api::logprobs_of(&row, token, *k));
                    }
                    if l.job.keep_logits {
                        l.logits.push(row);
                    }
                }
                if stop {
                    return self.end(b, req, Finish::Stop);
                }
                let shown = if l.job.text_only {
                    self.hidden.shown(token, &bytes)
                } else {
                    &bytes[..]
                };
                let delta = l.text.push(shown);
                if !delta.is_empty() && l.job.events.send(Event::Text(delta)).is_err() {
                    // The client went away.
                    return self.end(b, req, Finish::Cancelled);
                }
                if l.text.stopped() {
                    return self.end(b, req, Finish::Stop);
                }
                if l.ids.len() >= l.job.max_tokens {
                    // The backend ends it by itself at its length.
                    l.finish = Finish::Length;
                    answer_done(l, req, stats);
                }
            }
            WarmEvent::Pass(p) => {
                stats.passes.fetch_add(1, Ordering::Relaxed);
                stats.rows.observe(f64::from(p.rows));
                stats.decode_rows.observe(f64::from(p.decode_rows));
                stats
                    .expert_requests
                    .fetch_add(p.expert_requests, Ordering::Relaxed);
                stats
                    .resident_hits
                    .fetch_add(p.resident_hits, Ordering::Relaxed);
            }
            WarmEvent::Done { req, .. } => {
                if let Some(mut l) = self.live.remove(&req) {
                    if !l.answered {
                        answer_done(&mut l, req, stats);
                    }
                    self.release(&l);
                }
            }
            WarmEvent::Failed { req, error } => {
                if let Some(l) = self.live.remove(&req) {
                    if !l.answered {
                        log_end(&l, req, &format!("error ({error})"), stats);
                        answer_error(&l.job, &error, stats);
                    }
                    self.release(&l);
                }
            }
            // Answered in `Backend::state`.
            WarmEvent::State { .. } => {}
        }
        Ok(())
    }

    /// A job left the backend: its slot (or queue place) is free.
    fn release(&self, l: &Live) {
        let st = self.stats;
        if l.started {
            st.busy.fetch_sub(1, Ordering::SeqCst);
        } else {
            st.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        st.queue.fetch_sub(1, Ordering::SeqCst);
    }

    /// The backend failed as a whole: every job in flight fails with the reason, and the
    /// backend recovers (the stages are restarted) for the next ones.
    fn fault(&mut self, b: &mut dyn Backend, e: &BackendError) {
        let why = e.to_string();
        let next = if self.stats.closing.load(Ordering::SeqCst) {
            "the server is shutting down"
        } else {
            "the stages are being restarted"
        };
        for (id, l) in self.live.drain() {
            if !l.answered {
                log_end(&l, id, &format!("error ({why})"), self.stats);
                answer_error(&l.job, &format!("{why}; {next}"), self.stats);
            }
            let st = self.stats;
            if l.started {
                st.busy.fetch_sub(1, Ordering::SeqCst);
            } else {
                st.waiting.fetch_sub(1, Ordering::SeqCst);
            }
            st.queue.fetch_sub(1, Ordering::SeqCst);
        }
        if let BackendError::Fault(why) = e {
            b.restart(why);
        }
    }
}

/// Seconds from taking a slot (or arriving, if it never took one) to the first token;
/// seconds from the first token to the last.
fn timings(l: &Live) -> (f64, f64) {
    let from = l.started_at.unwrap_or(l.job.arrived);
    let prefill = l
        .first_token
        .map_or(0.0, |t| t.duration_since(from).as_secs_f64());
    let decode = match (l.first_token, l.last_token) {
        (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
        _ => 0.0,
    };
    (prefill, decode)
}

/// The request's one log line as it ends (when the server logs requests): its id, prompt,
/// cached and completion tokens, prefill seconds, decode tokens/s and how it ended.
fn log_end(l: &Live, id: u64, finish: &str, stats: &Stats) {
    if !stats.log_requests.load(Ordering::Relaxed) {
        return;
    }
    let (prefill, decode) = timings(l);
    let tps = if l.ids.len() > 1 && decode > 0.0 {
        (l.ids.len() - 1) as f64 / decode
    } else {
        0.0
    };
    tracing::info!(
        "request {id}: {} prompt tokens ({} cached), {} completion tokens, prefill {prefill:.2} s, \
         {tps:.2} tokens/s, finish {finish}",
        l.job.prompt.len(),
        l.cached,
        l.ids.len(),
    );
}

/// Send a job its `Done` (the text held back is flushed first), count it and log it.
fn answer_done(l: &mut Live, id: u64, stats: &Stats) {
    if l.answered {
        return;
    }
    l.answered = true;
    log_end(l, id, l.finish.as_str(), stats);
    let rest = l.text.finish();
    if !rest.is_empty() {
        let _ = l.job.events.send(Event::Text(rest));
    }
    let (prefill_seconds, seconds) = timings(l);
    if l.ids.len() > 1 && seconds > 0.0 {
        stats
            .request_tps
            .observe((l.ids.len() - 1) as f64 / seconds);
    }
    let d = Done {
        finish: l.finish,
        prompt_tokens: l.job.prompt.len(),
        completion_tokens: l.ids.len(),
        cached_tokens: l.cached,
        ids: std::mem::take(&mut l.ids),
        logits: std::mem::take(&mut l.logits),
        seconds,
        prefill_seconds,
    };
    stats
        .prompt_tokens
        .fetch_add(d.prompt_tokens as u64, Ordering::Relaxed);
    stats
        .completion_tokens
        .fetch_add(d.completion_tokens as u64, Ordering::Relaxed);
    stats
        .cached_tokens
        .fetch_add(d.cached_tokens as u64, Ordering::Relaxed);
    let _ = l.job.events.send(Event::Done(d));
}

/// Send a job its error and count it.
fn answer_error(job: &Job, e: &str, stats: &Stats) {
    stats.failed.fetch_add(1, Ordering::Relaxed);
    let _ = job.events.send(Event::Error(e.to_string()));
}

// --- the in-process backend (`--single-process`)

/// The scheduler over the memory-mapped shards, in this process.
struct InProc<'a> {
    model: &'a Model<Weights>,
    sched: Scheduler,
    pool: &'a k3_layer_compute::pool::ThreadPool,
    tok: Option<&'a Tokenizer>,
    o: &'a EngineOptions,
}

impl Backend for InProc<'_> {
    fn submit(&mut self, q: &WarmRequest) -> Result<u64, BackendError> {
        self.sched.prefix_cache().cap = q.cache_entries;
        let r = batch::Request {
            prompt: q.prompt.clone(),
            max_tokens: q.gen,
            sampler: q.sampler,
            stop_ids: q.stop_ids.clone(),
            cancel: Arc::new(AtomicBool::new(false)),
            keep_logits: q.keep_logits,
            snapshot_at: q.snapshot_at,
        };
        self.sched
            .submit(r)
            .map_err(|e| BackendError::Refused(e.to_string()))
    }

    fn stop(&mut self, id: u64) -> Result<(), BackendError> {
        self.sched.cancel(id);
        Ok(())
    }

    fn events(&mut self, _wait: Duration) -> Result<Vec<WarmEvent>, BackendError> {
        if self.sched.is_idle() {
            return Ok(Vec::new());
        }
        let t0 = Instant::now();
        let (model, sched) = (self.model, &mut self.sched);
        let rep = self.pool.install(|| sched.step(model));
        let seconds = t0.elapsed().as_secs_f64();
        if let Some(e) = &rep.error {
            tracing::error!("k3-orch serve: {e}");
        }
        for m in &rep.stats.failure_msgs {
            tracing::warn!("k3-orch serve: {m}");
        }
        let failures = rep.stats.expert_failures as u64;
        let mut out = Vec::with_capacity(rep.events.len() + 1);
        for ev in rep.events {
            out.push(match ev {
                batch::Event::Started {
                    id, cached_tokens, ..
                } => WarmEvent::Started {
                    req: id,
                    cached_tokens,
                },
                batch::Event::Prefill { .. } => continue,
                batch::Event::Token {
                    id,
                    index,
                    token,
                    logits,
                } => WarmEvent::Token {
                    req: id,
                    index,
                    token,
                    bytes: id_bytes(self.tok, token),
                    expert_failures: failures,
                    logits,
                },
                batch::Event::Finished { id, generated, .. } => {
                    WarmEvent::Done { req: id, generated }
                }
                batch::Event::Failed { id, error } => WarmEvent::Failed { req: id, error },
            });
        }
        if rep.rows > 0 {
            let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
            let requests = rep.stats.expert_requests as u64;
            out.push(WarmEvent::Pass(PassStats {
                rows: n(rep.rows),
                decode_rows: n(rep.decode_rows),
                prefill_rows: n(rep.prefill_rows),
                busy: n(self.sched.busy()),
                queued: n(self.sched.queued()),
                seconds,
                expert_requests: requests,
                // Every expert is mapped: each lookup is a hit.
                resident_hits: requests,
                expert_failures: failures,
                ..PassStats::default()
            }));
        }
        Ok(out)
    }

    fn state(&mut self, op: &StateOp) -> Result<usize, EngineError> {
        let fp = state_fingerprint(self.o)?;
        let cache = self.sched.prefix_cache();
        match op {
            StateOp::Save { path, conversation } => {
                let (bytes, n) = k3_layer_compute::state::encode_prefix(cache, conversation, &fp)?;
                k3_io::output::write_atomic(path, &bytes).map_err(|source| EngineError::File {
                    path: path.clone(),
                    source,
                })?;
                Ok(n)
            }
            StateOp::Load { path, conversation } => {
                let bytes = k3_layer_compute::state::read(path).map_err(EngineError::StateFile)?;
                let (key, sess) =
                    k3_layer_compute::state::decode_prefix(&bytes, &fp, self.model, conversation)?;
                let n = key.len();
                cache.cap = self.o.cache_entries;
                cache.insert(key, sess);
                Ok(n)
            }
        }
    }
}

/// The scheduler's options for the engine's slots.
fn scheduler_options(s: &SlotOptions, cache_entries: usize) -> SchedulerOptions {
    SchedulerOptions {
        slots: s.slots.max(1),
        max_queue: s.max_queue,
        chunk: s.prefill_chunk.max(1),
        ctx: s.ctx.max(1),
        prefix_entries: cache_entries,
    }
}

fn inproc_worker(
    o: EngineOptions,
    cfg: ModelConfig,
    tok: Option<Arc<Tokenizer>>,
    rx: mpsc::Receiver<Work>,
    stats: Arc<Stats>,
) {
    let fail = |e: String| {
        tracing::error!("k3-orch serve: loading the model: {e}");
        if let Ok(mut g) = stats.load_error.lock() {
            *g = Some(e);
        }
    };
    k3_layer_compute::kernels::tuning::install(k3_layer_compute::kernels::tuning::from_env());
    let pool = match k3_layer_compute::pool::build(o.threads) {
        Ok(p) => p,
        Err(e) => return fail(e.to_string()),
    };
    let mw = match MmapWeights::open(&o.model_dir) {
        Ok(m) => m,
        Err(e) => return fail(e.to_string()),
    };
    let model = match Model::new(
        cfg,
        SourceWeights::new(mw),
        ModelOptions {
            threads: o.threads,
            layers: o.layers,
            eps: None,
        },
    ) {
        Ok(m) => m,
        Err(e) => return fail(e.to_string()),
    };
    if let Err(e) = model.check_binding() {
        return fail(e.to_string());
    }
    let mut sched = match Scheduler::new(&model, scheduler_options(&o.slots, o.cache_entries)) {
        Ok(s) => s,
        Err(e) => return fail(e.to_string()),
    };
    sched.prefix_cache().byte_cap = usize::try_from(o.slots.prefix_bytes).unwrap_or(usize::MAX);
    stats.ready.store(true, Ordering::SeqCst);
    tracing::info!("k3-orch serve: model loaded");
    let stop_ids = tok.as_ref().map_or_else(Vec::new, |t| t.stop_ids());
    let mut b = InProc {
        model: &model,
        sched,
        pool: &pool,
        tok: tok.as_deref(),
        o: &o,
    };
    Driver {
        stats: &stats,
        stop_ids,
        hidden: HiddenIds::of(tok.as_deref()),
        cache_entries: o.cache_entries,
        live: HashMap::new(),
        held_ops: VecDeque::new(),
    }
    .run(&mut b, &rx);
}

// --- the warm-stage backend (the default)

/// Start the warm stages; a failure is logged.
fn start_warm(launch: &Launch, stats: &Stats) -> Result<Warm, EngineError> {
    let t0 = Instant::now();
    match Warm::start(launch) {
        Ok(w) => {
            // Registered under the lock `Engine::stop_stages_now` holds, so stages started
            // while it runs are not missed: they are stopped here instead.
            match stats.stopper.lock() {
                Ok(mut g) if !stats.closing.load(Ordering::SeqCst) => *g = Some(w.stopper()),
                _ => {
                    w.kill();
                    return Err(EngineError::ShuttingDown);
                }
            }
            tracing::info!(
                "k3-orch serve: stages up in {:.1} s ({})",
                t0.elapsed().as_secs_f64(),
                w.pids()
                    .iter()
                    .map(|(s, p)| format!("{s} pid {p}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            if let Ok(mut g) = stats.stages.lock() {
                *g = w.memory();
            }
            Ok(w)
        }
        Err(e) => Err(EngineError::Start(e)),
    }
}

/// The warm-stage backend: start the pipeline once, run every job on it, start it again
/// after a fault.
fn warm_worker(
    o: &EngineOptions,
    launch: Launch,
    tok: Option<Arc<Tokenizer>>,
    rx: mpsc::Receiver<Work>,
    stats: Arc<Stats>,
) {
    let stop_ids = tok.as_ref().map_or_else(Vec::new, |t| t.stop_ids());
    let warm = match start_warm(&launch, &stats) {
        Ok(w) => w,
        Err(e) => {
            tracing::error!("k3-orch serve: starting the stages: {e}");
            if let Ok(mut g) = stats.load_error.lock() {
                *g = Some(e.to_string());
            }
            return;
        }
    };
    stats.ready.store(true, Ordering::SeqCst);
    tracing::info!("k3-orch serve: model loaded");
    let mut b = Staged {
        o,
        launch: &launch,
        stats: &stats,
        warm: Some(warm),
        last_memory: Instant::now(),
        failed_starts: 0,
        next_start: Instant::now(),
    };
    Driver {
        stats: &stats,
        stop_ids,
        hidden: HiddenIds::of(tok.as_deref()),
        cache_entries: o.cache_entries,
        live: HashMap::new(),
        held_ops: VecDeque::new(),
    }
    .run(&mut b, &rx);
    if let Some(w) = b.warm.take() {
        w.shutdown(Duration::from_millis(1500));
    }
    if let Ok(mut g) = stats.stages.lock() {
        g.clear();
    }
}

/// The warm pipeline of [`warm_worker`], started again after a fault.
struct Staged<'a> {
    o: &'a EngineOptions,
    launch: &'a Launch,
    stats: &'a Stats,
    /// None while the stages are down (they could not be started again, or the server is
    /// closing).
    warm: Option<Warm>,
    /// When the stages' memory was last read for `/metrics`.
    last_memory: Instant,
    /// Starts that failed in a row, and when to try again (backoff).
    failed_starts: u32,
    next_start: Instant,
}

/// Starts in a row that may fail before `/health` says 500 (the server keeps trying).
const START_TRIES: u32 = 5;

/// Seconds before the first try to start failed stages again: 0.5, or the test hook's
/// (`K3_TEST_RESTART_BACKOFF_MS`, checked when the server opened the model).
fn restart_backoff() -> f64 {
    match crate::run::launch::numeric_hook(crate::run::launch::RESTART_BACKOFF_ENV) {
        Ok(Some(ms)) => ms as f64 / 1000.0,
        _ => 0.5,
    }
}

impl Staged<'_> {
    /// Stop the stages (when up) and start them again, unless the server is closing.
    fn restart(&mut self, why: &str) {
        if let Some(w) = self.warm.take() {
            w.kill();
        }
        if self.stats.closing.load(Ordering::SeqCst) {
            return;
        }
        self.stats.restarts.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("k3-orch serve: {why}; starting the stages again");
        self.start_again();
    }

    /// Start the stages; a failure is tried again later, after 0.5 s, 1 s, 2 s... (at most
    /// 30 s), and after [`START_TRIES`] in a row `/health` answers 500 with the reason
    /// (until a start succeeds).
    fn start_again(&mut self) {
        if Instant::now() < self.next_start {
            return;
        }
        self.stats.ready.store(false, Ordering::SeqCst);
        match start_warm(self.launch, self.stats) {
            Ok(w) => {
                self.failed_starts = 0;
                if let Ok(mut g) = self.stats.load_error.lock() {
                    *g = None;
                }
                self.stats.ready.store(true, Ordering::SeqCst);
                self.warm = Some(w);
            }
            Err(e) => {
                self.failed_starts += 1;
                let wait = (restart_backoff() * 2f64.powi(self.failed_starts as i32 - 1)).min(30.0);
                self.next_start = Instant::now() + Duration::from_secs_f64(wait);
                tracing::error!(
                    "k3-orch serve: restarting the stages ({} in a row failed; next try in \
                     {wait:.1} s): {e}",
                    self.failed_starts
                );
                if self.failed_starts >= START_TRIES {
                    if let Ok(mut g) = self.stats.load_error.lock() {
                        *g = Some(format!(
                            "the stages could not be started again ({} tries): {e}",
                            self.failed_starts
                        ));
                    }
                }
            }
        }
    }

    /// The stages, started again when down; an error when they cannot be.
    fn up(&mut self) -> Result<&mut Warm, BackendError> {
        if self.warm.is_none() && !self.stats.closing.load(Ordering::SeqCst) {
            self.start_again();
        }
        self.warm
            .as_mut()
            .ok_or_else(|| BackendError::Refused("the stages could not be started again".into()))
    }

    /// The stages' memory for `/metrics`, at most twice a second.
    fn memory(&mut self) {
        if self.last_memory.elapsed() < Duration::from_millis(500) {
            return;
        }
        self.last_memory = Instant::now();
        if let (Some(w), Ok(mut g)) = (self.warm.as_ref(), self.stats.stages.lock()) {
            *g = w.memory();
        }
    }
}

/// A pipeline failure as the backend's fault (the stage and the cause).
fn fault(e: crate::error::RunError) -> BackendError {
    BackendError::Fault(e.msg.trim_start_matches("k3-orch: ").to_string())
}

impl Backend for Staged<'_> {
    fn submit(&mut self, q: &WarmRequest) -> Result<u64, BackendError> {
        self.up()?.submit(q).map_err(fault)
    }

    fn stop(&mut self, id: u64) -> Result<(), BackendError> {
        match self.warm.as_mut() {
            Some(w) => w.stop(id).map_err(fault),
            None => Ok(()),
        }
    }

    fn events(&mut self, wait: Duration) -> Result<Vec<WarmEvent>, BackendError> {
        let r = match self.warm.as_mut() {
            Some(w) => w.events(wait).map_err(fault),
            None => Err(BackendError::Fault("the stages are down".into())),
        };
        self.memory();
        r
    }

    fn state(&mut self, op: &StateOp) -> Result<usize, EngineError> {
        let cache_entries = self.o.cache_entries;
        let fp = state_fingerprint(self.o)?;
        let w = self.up()?;
        let r = match op {
            StateOp::Save { path, conversation } => w.save_state(path, &fp, conversation),
            StateOp::Load { path, conversation } => {
                w.load_state(path, &fp, conversation, cache_entries)
            }
        };
        // The outer error is the stages failing (restart them); the inner one the state
        // refused (the stages are fine).
        match r {
            Ok(r) => r.map_err(EngineError::Stage),
            Err(e) => {
                let why = e.msg.trim_start_matches("k3-orch: ").to_string();
                Staged::restart(self, &why);
                Err(EngineError::Restarted(why))
            }
        }
    }

    /// A stage that died (while idle too) is noticed here, and the stages started again;
    /// stages that could not be started are tried again (with backoff).
    fn idle(&mut self) {
        match self.warm.as_mut().map(Warm::poll) {
            Some(Err(e)) => {
                let why = e.msg.trim_start_matches("k3-orch: ").to_string();
                Staged::restart(self, &why);
            }
            Some(Ok(())) => {}
            None if !self.stats.closing.load(Ordering::SeqCst) => self.start_again(),
            None => {}
        }
        self.memory();
    }

    fn restart(&mut self, why: &str) {
        Staged::restart(self, why);
    }
}
