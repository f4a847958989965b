//! The generation engine behind `serve` and `chat`: one worker thread that owns the model
//! (loaded once), the tokenizer and the prefix cache, and runs jobs one at a time in arrival
//! order.
//!
//! Two backends, with the same decode semantics and sampler as every other mode, so a
//! greedy or seeded request gives the ids `k3-orch DIR --incremental` gives for the same
//! prompt:
//! - **warm stages** (the default): the product's pipeline, the four stage processes each in
//!   its own cgroup, started once and kept up ([`crate::supervise::warm`]); the trunk is
//!   loaded once. A stage that dies fails the request in progress (an error naming the stage
//!   and the cause) and the stages are started again for the next one. `/metrics` reads each
//!   stage's cgroup.
//! - **`--single-process`**: the forward over the memory-mapped shards in this process.
//!
//! Prefix reuse: after each job the session state (MLA KV cache, KDA recurrent state and
//! conv tails, all in a `Session`) is kept, keyed by the tokens it has consumed — one entry
//! at the end of the prompt's last complete message (`snapshot_at`), one at the end of
//! generation. A later prompt that starts with a kept key clones that state and prefills
//! only the rest; `cached_tokens` says how many tokens were skipped. With warm stages the
//! layer-compute stage keeps the states ([`k3_layer_compute::decode::PrefixCache`]).
//!
//! Saved sessions (`k3-orch chat`'s `/save` and `/load`): [`Engine::save_state`] writes the
//! kept state for a conversation to a state file (`k3_layer_compute::state`, the
//! `--save-state` format, with this model's fingerprint) and [`Engine::load_state`] puts one
//! back in the prefix cache; with warm stages layer-compute does both (`SaveState` /
//! `LoadState` on its control socket). They run on the worker between jobs, in order.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use k3_layer_compute::decode::PrefixCache;
use k3_layer_compute::forward::{Model, ModelOptions};
use k3_layer_compute::sampler;
use k3_layer_compute::weights::SourceWeights;
use k3_model::config::ModelConfig;
use k3_model::mmap_weights::MmapWeights;
use k3_protocol::conf::SamplerConfig;
use k3_tokenizer::Tokenizer;

use crate::run::stream::TextStream;
use crate::supervise::warm::{StageMemory, Warm, WarmObserver, WarmRequest};
use crate::supervise::Launch;
use k3_protocol::messages::StepStats;

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
    /// Set by the caller to end the job early (client gone, server draining).
    pub cancel: Arc<AtomicBool>,
    pub events: tokio::sync::mpsc::UnboundedSender<Event>,
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
    pub seconds: f64,
}

/// Counters for `/metrics`.
#[derive(Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub expert_requests: AtomicU64,
    /// Queued plus running jobs.
    pub queue: AtomicUsize,
    /// Tokens/s of the last finished job's decode, as f64 bits.
    pub last_tps_bits: AtomicU64,
    /// Routed-expert lookups served from experts already resident.
    pub resident_hits: AtomicU64,
    /// Times the stages were started again after a fault.
    pub restarts: AtomicU64,
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
}

/// A session-state operation for the worker (`chat`'s `/save` and `/load`).
enum StateOp {
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
    State(StateOp, mpsc::Sender<Result<usize, String>>),
}

/// How to load the engine.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub model_dir: std::path::PathBuf,
    pub config_path: std::path::PathBuf,
    pub tok_dir: std::path::PathBuf,
    pub threads: usize,
    pub layers: Option<usize>,
    /// Prefix-cache entries kept (0: no reuse).
    pub cache_entries: usize,
    /// The warm pipeline to run (None: `--single-process`).
    pub warm: Option<Launch>,
}

/// Handle to the worker thread.
pub struct Engine {
    jobs: Mutex<mpsc::Sender<Work>>,
    pub stats: Arc<Stats>,
    pub tok: Arc<Tokenizer>,
    pub vocab: usize,
    pub model_name: String,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Engine {
    /// Load the tokenizer now; start the worker, which loads the model (`stats.ready` turns
    /// true when it is done; a load failure is kept in `stats.load_error`).
    pub fn start(o: EngineOptions) -> Result<Engine, String> {
        let tok = Arc::new(
            Tokenizer::from_dir(&o.tok_dir)
                .map_err(|e| format!("--tok {}: {e}", o.tok_dir.display()))?,
        );
        let cfg = ModelConfig::load(&o.config_path).map_err(|e| e.to_string())?;
        if (tok.n_vocab() as usize) > cfg.vocab_size {
            return Err(format!(
                "the tokenizer has {} ids but the model's vocabulary is {}",
                tok.n_vocab(),
                cfg.vocab_size
            ));
        }
        let vocab = cfg.vocab_size;
        let stats = Arc::new(Stats::default());
        let (tx, rx) = mpsc::channel::<Work>();
        let st = stats.clone();
        let tk = tok.clone();
        let worker = std::thread::Builder::new()
            .name("k3-engine".into())
            .spawn(move || match o.warm.clone() {
                Some(l) => warm_worker(&o, l, tk, rx, st),
                None => worker(o, cfg, tk, rx, st),
            })
            .map_err(|e| format!("cannot start the engine thread: {e}"))?;
        let model_name = "k3".to_string();
        Ok(Engine {
            jobs: Mutex::new(tx),
            stats,
            tok,
            vocab,
            model_name,
            worker: Mutex::new(Some(worker)),
        })
    }

    /// Queue a job (the caller has counted it in `stats.queue`).
    pub fn submit(&self, job: Job) -> Result<(), String> {
        self.jobs
            .lock()
            .map_err(|_| "engine lock poisoned".to_string())?
            .send(Work::Job(job))
            .map_err(|_| "the engine has stopped".to_string())
    }

    /// Write the session state kept for `conversation` (the tokens of the conversation so
    /// far, as the next turn's prompt starts) to the state file `path`; how many tokens it
    /// holds. Runs after the jobs queued before it.
    pub fn save_state(
        &self,
        path: &std::path::Path,
        conversation: &[u32],
    ) -> Result<usize, String> {
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
    ) -> Result<usize, String> {
        self.state_op(StateOp::Load {
            path: absolute(path)?,
            conversation: conversation.to_vec(),
        })
    }

    fn state_op(&self, op: StateOp) -> Result<usize, String> {
        let (tx, rx) = mpsc::channel();
        self.jobs
            .lock()
            .map_err(|_| "engine lock poisoned".to_string())?
            .send(Work::State(op, tx))
            .map_err(|_| "the engine has stopped".to_string())?;
        rx.recv().map_err(|_| "the engine stopped".to_string())?
    }

    /// Wait until the model is loaded or failed to load.
    pub fn wait_ready(&self) -> Result<(), String> {
        loop {
            if self.stats.ready.load(Ordering::SeqCst) {
                return Ok(());
            }
            if let Some(e) = self.stats.load_error.lock().ok().and_then(|g| g.clone()) {
                return Err(e);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// The shutdown deadline: no restart from now on, and the warm stages are killed and
    /// reaped and their cgroups removed now, from this thread, whatever the worker is doing
    /// (a stage that does not answer cannot hold the exit up). The job in progress fails.
    pub fn stop_stages_now(&self) {
        self.stats.closing.store(true, Ordering::SeqCst);
        self.stats.abort.store(true, Ordering::SeqCst);
        if let Ok(g) = self.stats.stopper.lock() {
            if let Some(s) = g.as_ref() {
                s.stop_now();
            }
        }
    }

    /// Stop taking jobs and wait for the worker to finish the queued ones.
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
fn absolute(path: &std::path::Path) -> Result<std::path::PathBuf, String> {
    std::path::absolute(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The model's fingerprint for state files, as `--save-state` computes it.
fn state_fingerprint(o: &EngineOptions) -> Result<String, String> {
    let cfg = ModelConfig::load(&o.config_path).map_err(|e| e.to_string())?;
    let layers = o
        .layers
        .unwrap_or(cfg.num_hidden_layers)
        .min(cfg.num_hidden_layers);
    k3_layer_compute::state::fingerprint(&o.config_path, &o.model_dir, layers)
        .map_err(|e| format!("model fingerprint: {e}"))
}

fn worker(
    o: EngineOptions,
    cfg: ModelConfig,
    tok: Arc<Tokenizer>,
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
    stats.ready.store(true, Ordering::SeqCst);
    tracing::info!("k3-orch serve: model loaded");
    let stop_ids = tok.stop_ids();
    let mut cache = PrefixCache::new(o.cache_entries);
    while let Ok(work) = rx.recv() {
        match work {
            Work::Job(job) => {
                let res =
                    pool.install(|| run_job(&model, &tok, &stop_ids, &mut cache, &job, &stats));
                finish_job(&job, res, &stats);
            }
            Work::State(op, answer) => {
                let res = state_fingerprint(&o).and_then(|fp| match op {
                    StateOp::Save { path, conversation } => {
                        let (bytes, n) =
                            k3_layer_compute::state::encode_prefix(&mut cache, &conversation, &fp)
                                .map_err(|e| e.to_string())?;
                        k3_io::output::write_atomic(&path, &bytes)
                            .map_err(|e| format!("{}: {e}", path.display()))?;
                        Ok(n)
                    }
                    StateOp::Load { path, conversation } => {
                        let bytes =
                            k3_layer_compute::state::read(&path).map_err(|e| e.without_flag())?;
                        let (key, sess) = k3_layer_compute::state::decode_prefix(
                            &bytes,
                            &fp,
                            &model,
                            &conversation,
                        )
                        .map_err(|e| e.to_string())?;
                        let n = key.len();
                        cache.insert(key, sess);
                        Ok(n)
                    }
                });
                let _ = answer.send(res);
            }
        }
    }
}

/// Report a finished job and count it.
fn finish_job(job: &Job, res: Result<Done, String>, stats: &Stats) {
    match res {
        Ok(d) => {
            stats
                .prompt_tokens
                .fetch_add(d.prompt_tokens as u64, Ordering::Relaxed);
            stats
                .completion_tokens
                .fetch_add(d.completion_tokens as u64, Ordering::Relaxed);
            stats
                .cached_tokens
                .fetch_add(d.cached_tokens as u64, Ordering::Relaxed);
            if d.seconds > 0.0 {
                stats.last_tps_bits.store(
                    (d.completion_tokens as f64 / d.seconds).to_bits(),
                    Ordering::Relaxed,
                );
            }
            let _ = job.events.send(Event::Done(d));
        }
        Err(e) => {
            stats.failed.fetch_add(1, Ordering::Relaxed);
            let _ = job.events.send(Event::Error(e));
        }
    }
    stats.queue.fetch_sub(1, Ordering::SeqCst);
}

/// Start the warm stages; a failure is logged.
fn start_warm(launch: &Launch, stats: &Stats) -> Result<Warm, String> {
    let t0 = Instant::now();
    match Warm::start(launch) {
        Ok(w) => {
            // Registered under the lock `Engine::stop_stages_now` holds, so stages started
            // while it runs are not missed: they are stopped here instead.
            match stats.stopper.lock() {
                Ok(mut g) if !stats.closing.load(Ordering::SeqCst) => *g = Some(w.stopper()),
                _ => {
                    w.kill();
                    return Err("the server is shutting down".into());
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
        Err(e) => Err(e.msg.trim_start_matches("k3-orch: ").to_string()),
    }
}

/// The warm-stage backend: start the pipeline once, run every job on it, start it again
/// after a fault.
fn warm_worker(
    o: &EngineOptions,
    launch: Launch,
    tok: Arc<Tokenizer>,
    rx: mpsc::Receiver<Work>,
    stats: Arc<Stats>,
) {
    let stop_ids = tok.stop_ids();
    let warm = match start_warm(&launch, &stats) {
        Ok(w) => w,
        Err(e) => {
            tracing::error!("k3-orch serve: starting the stages: {e}");
            if let Ok(mut g) = stats.load_error.lock() {
                *g = Some(e);
            }
            return;
        }
    };
    stats.ready.store(true, Ordering::SeqCst);
    tracing::info!("k3-orch serve: model loaded");
    let mut b = Backend {
        o,
        launch: &launch,
        stats: &stats,
        warm: Some(warm),
    };
    loop {
        match rx.recv_timeout(std::time::Duration::from_millis(500)) {
            Ok(Work::State(op, answer)) => {
                let _ = answer.send(b.state(&op));
            }
            Ok(Work::Job(job)) if stats.closing.load(Ordering::SeqCst) => {
                finish_job(&job, Err("the server is shutting down".into()), &stats);
            }
            Ok(Work::Job(job)) => b.job(&job, &stop_ids),
            Err(mpsc::RecvTimeoutError::Timeout) => b.check(),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if let (Some(w), Ok(mut g)) = (b.warm.as_ref(), stats.stages.lock()) {
            *g = w.memory();
        }
    }
    if let Some(w) = b.warm {
        w.shutdown(std::time::Duration::from_millis(1500));
    }
    if let Ok(mut g) = stats.stages.lock() {
        g.clear();
    }
}

/// The warm pipeline of [`warm_worker`], started again after a fault.
struct Backend<'a> {
    o: &'a EngineOptions,
    launch: &'a Launch,
    stats: &'a Stats,
    /// None while the stages are down (they could not be started again, or the server is
    /// closing).
    warm: Option<Warm>,
}

impl Backend<'_> {
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
        match start_warm(self.launch, self.stats) {
            Ok(w) => {
                self.stats.ready.store(true, Ordering::SeqCst);
                self.warm = Some(w);
            }
            Err(e) => {
                tracing::error!("k3-orch serve: restarting the stages: {e}");
                self.stats.ready.store(false, Ordering::SeqCst);
            }
        }
    }

    /// A stage that died (while idle too) is noticed here, and the stages started again.
    fn check(&mut self) {
        if let Some(Err(e)) = self.warm.as_mut().map(Warm::poll) {
            let why = e.msg.trim_start_matches("k3-orch: ").to_string();
            self.restart(&why);
        }
    }

    /// The stages, checked and started again when down; None when they cannot be.
    fn up(&mut self) -> Option<&mut Warm> {
        self.check();
        if self.warm.is_none() {
            self.restart("the stages are down");
        }
        self.warm.as_mut()
    }

    /// Save or load a session state on the stages; a failure restarts them.
    fn state(&mut self, op: &StateOp) -> Result<usize, String> {
        let cache_entries = self.o.cache_entries;
        let fp = state_fingerprint(self.o);
        let r = match (self.up(), fp) {
            (None, _) => return Err("the stages could not be started again".to_string()),
            (Some(_), Err(e)) => return Err(e),
            (Some(w), Ok(fp)) => match op {
                StateOp::Save { path, conversation } => w.save_state(path, &fp, conversation),
                StateOp::Load { path, conversation } => {
                    w.load_state(path, &fp, conversation, cache_entries)
                }
            },
        };
        // The outer error is the stages failing (restart them); the inner one the state
        // refused (the stages are fine).
        r.unwrap_or_else(|e| {
            let why = e.msg.trim_start_matches("k3-orch: ").to_string();
            self.restart(&why);
            Err(format!("{why}; the stages were restarted"))
        })
    }

    /// Run one job on the stages; a failure ends it with the reason and restarts them.
    fn job(&mut self, job: &Job, stop_ids: &[u32]) {
        let (stats, cache_entries) = (self.stats, self.o.cache_entries);
        let Some(w) = self.up() else {
            finish_job(
                job,
                Err("the stages could not be started again".into()),
                stats,
            );
            return;
        };
        match run_warm_job(w, stop_ids, job, stats, cache_entries) {
            Ok(d) => finish_job(job, Ok(d), stats),
            Err(e) => {
                let why = e.trim_start_matches("k3-orch: ").to_string();
                let next = if stats.closing.load(Ordering::SeqCst) {
                    "the server is shutting down"
                } else {
                    "the stages are being restarted"
                };
                finish_job(job, Err(format!("{why}; {next}")), stats);
                self.restart(&why);
            }
        }
    }
}

/// What one warm job reports as its tokens arrive.
struct JobObserver<'a> {
    job: &'a Job,
    stats: &'a Stats,
    stop_ids: &'a [u32],
    text: TextStream,
    ids: Vec<u32>,
    finish: Finish,
    /// A step whose routed experts did not all load (the step, its failures): the request
    /// ends there with an error, never with text computed without them.
    unsound: Option<(u32, u64)>,
}

impl WarmObserver for JobObserver<'_> {
    fn started(&mut self, cached_tokens: usize) {
        let _ = self.job.events.send(Event::Started { cached_tokens });
    }

    fn token(&mut self, st: &StepStats, bytes: &[u8]) -> bool {
        self.stats
            .expert_requests
            .fetch_add(st.expert_requests, Ordering::Relaxed);
        self.stats
            .resident_hits
            .fetch_add(st.resident_hits, Ordering::Relaxed);
        if st.expert_failures > 0 {
            self.unsound = Some((st.step, st.expert_failures));
            return true;
        }
        self.ids.push(st.token);
        if self.stop_ids.contains(&st.token) {
            self.finish = Finish::Stop;
            return true;
        }
        let delta = self.text.push(bytes);
        if !delta.is_empty() && self.job.events.send(Event::Text(delta)).is_err() {
            self.finish = Finish::Cancelled; // the client went away
            return true;
        }
        if self.text.stopped() {
            self.finish = Finish::Stop;
            return true;
        }
        if self.ids.len() >= self.job.max_tokens {
            return true;
        }
        false
    }

    fn cancelled(&mut self) -> bool {
        let c = self.job.cancel.load(Ordering::Relaxed) || self.stats.abort.load(Ordering::Relaxed);
        if c && self.finish == Finish::Length {
            self.finish = Finish::Cancelled;
        }
        c
    }
}

fn run_warm_job(
    w: &mut Warm,
    stop_ids: &[u32],
    job: &Job,
    stats: &Stats,
    cache_entries: usize,
) -> Result<Done, String> {
    let t0 = Instant::now();
    let mut obs = JobObserver {
        job,
        stats,
        stop_ids,
        text: TextStream::new(&job.stop),
        ids: Vec::new(),
        finish: Finish::Length,
        unsound: None,
    };
    let d = w
        .generate(
            &WarmRequest {
                prompt: job.prompt.clone(),
                gen: job.max_tokens,
                sampler: job.sampler,
                stop_ids: stop_ids.to_vec(),
                snapshot_at: job.snapshot_at,
                cache_entries,
            },
            &mut obs,
        )
        .map_err(|e| e.msg)?;
    if let Some((step, n)) = obs.unsound {
        return Err(format!(
            "{n} routed expert(s) failed to load at generation step {step} (see the server \
             log): the request ends rather than answer with text computed without them"
        ));
    }
    let rest = obs.text.finish();
    if !rest.is_empty() {
        let _ = job.events.send(Event::Text(rest));
    }
    let seconds = t0.elapsed().as_secs_f64();
    Ok(Done {
        finish: obs.finish,
        prompt_tokens: job.prompt.len(),
        completion_tokens: obs.ids.len(),
        cached_tokens: d.cached_tokens,
        ids: obs.ids,
        seconds,
    })
}

fn run_job(
    model: &Model<Weights>,
    tok: &Tokenizer,
    stop_ids: &[u32],
    cache: &mut PrefixCache,
    job: &Job,
    stats: &Stats,
) -> Result<Done, String> {
    let t0 = Instant::now();
    let vocab = model.vocab();
    let (cached, mut sess) = cache
        .lookup(&job.prompt)
        .unwrap_or_else(|| (0, model.new_session()));
    let _ = job.events.send(Event::Started {
        cached_tokens: cached,
    });
    let ferr = |e: k3_layer_compute::forward::ForwardError| format!("forward pass failed: {e}");
    // Prefill: up to the snapshot point first (kept for the next turn), then the rest.
    let mut fed = cached;
    if let Some(b) = job
        .snapshot_at
        .filter(|&b| b > cached && b < job.prompt.len())
    {
        model
            .prefill(&mut sess, &job.prompt[cached..b])
            .map_err(ferr)?;
        cache.insert(job.prompt[..b].to_vec(), sess.clone());
        fed = b;
    }
    let mut out = model.prefill(&mut sess, &job.prompt[fed..]).map_err(ferr)?;
    let mut seq = job.prompt.clone();
    let mut ids = Vec::new();
    let mut text = TextStream::new(&job.stop);
    let mut finish = Finish::Length;
    let t_decode = Instant::now();
    for step in 0..job.max_tokens {
        if job.cancel.load(Ordering::Relaxed) || stats.abort.load(Ordering::Relaxed) {
            finish = Finish::Cancelled;
            break;
        }
        stats
            .expert_requests
            .fetch_add(out.stats.expert_requests as u64, Ordering::Relaxed);
        let row = &out.logits[(out.rows - 1) * vocab..out.rows * vocab];
        let id = sampler::sample(row, &job.sampler, step as u64, &seq) as u32;
        ids.push(id);
        seq.push(id);
        if stop_ids.contains(&id) {
            finish = Finish::Stop;
            break;
        }
        let bytes = tok
            .token_bytes(id)
            .map(<[u8]>::to_vec)
            .unwrap_or_else(|_| format!("<|bad_id_{id}|>").into_bytes());
        let delta = text.push(&bytes);
        if !delta.is_empty() && job.events.send(Event::Text(delta)).is_err() {
            finish = Finish::Cancelled; // the client went away
            break;
        }
        if text.stopped() {
            finish = Finish::Stop;
            break;
        }
        if step + 1 == job.max_tokens {
            break;
        }
        out = model.step(&mut sess, id).map_err(ferr)?;
    }
    let rest = text.finish();
    if !rest.is_empty() {
        let _ = job.events.send(Event::Text(rest));
    }
    // The session has consumed everything but the last id.
    let consumed = seq.len() - 1;
    if sess.len() == consumed {
        cache.insert(seq[..consumed].to_vec(), sess);
    }
    let seconds = t_decode.elapsed().as_secs_f64();
    let _ = t0;
    Ok(Done {
        finish,
        prompt_tokens: job.prompt.len(),
        completion_tokens: ids.len(),
        cached_tokens: cached,
        ids,
        seconds,
    })
}
