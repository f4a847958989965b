//! Launching a generation: the staged pipeline (processes, or threads with `--inproc`) or
//! the forward called directly (`--single-process`). Both run layer-compute's one decode
//! loop; this module only builds what each mode needs and collects what it returns.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use k3_layer_compute::decode::{decode_resumed, LoopOptions, Resume, Step, StepHooks};
use k3_layer_compute::forward::{Model, ModelOptions};
use k3_layer_compute::state::Start;
use k3_layer_compute::weights::SourceWeights;
use k3_model::config::ModelConfig;
use k3_model::mmap_weights::MmapWeights;
use k3_protocol::conf::{self, SamplerConfig};
use k3_protocol::messages::{Msg, Stage, StepStats};

use super::args::{GenArgs, Prompt};
use super::plan::{RunPlan, ServePlan, ServeShape};
use super::report::{self, StageReport};
use super::GenError;
use crate::supervise::{self, Launch, Mode, Observer};

/// What a generation produced, in any mode.
#[derive(Default)]
pub struct Generated {
    pub prompt_ids: Vec<u32>,
    pub generated: Vec<u32>,
    pub steps: Vec<StepStats>,
    /// Decoded output bytes (None when no tokenizer decoded them).
    pub text: Option<Vec<u8>>,
    pub stages: Vec<StageReport>,
    pub notes: Vec<String>,
    pub expert_failures: u64,
    pub summaries: BTreeMap<String, serde_json::Value>,
    /// Per step: seconds the busiest disk the run reads from was busy (empty: none watched).
    pub disk_busy: Vec<Option<f64>>,
    /// The disks watched for `disk_busy`.
    pub disks: Option<String>,
}

/// What every mode is given.
pub struct Common<'a> {
    pub args: &'a GenArgs,
    pub cfg: &'a ModelConfig,
    pub config_path: &'a Path,
    pub layers: usize,
    pub plan: &'a RunPlan,
    pub threads: usize,
    pub sampler: SamplerConfig,
    pub stop_ids: Vec<u32>,
    /// The `--tok` tokenizer, loaded once per run (None: ids in, ids out).
    pub tok: Option<std::sync::Arc<k3_tokenizer::Tokenizer>>,
}

/// What the user sees while a generation runs: the generated text streamed to stdout as
/// each token decodes (complete UTF-8 only, stop strings held back and cut), and the step
/// table with a progress/ETA on stderr (diagnostics: dropped by `--quiet`).
pub struct StepPrinter {
    pub quiet: bool,
    /// Decoded text (None: no tokenizer, ids in and ids out).
    pub stream: Option<super::stream::TextStream>,
    /// Tokens the run may generate (for the ETA).
    pub gen: usize,
    started: Option<std::time::Instant>,
    steps: usize,
    /// The disks the run reads from, and their `io_ticks` at the previous step's end.
    disk: Option<super::disk::DiskBusy>,
    last_ticks: Vec<Option<u64>>,
    /// Per step: seconds the busiest of those disks was busy (None: not measured).
    pub disk_busy: Vec<Option<f64>>,
}

impl StepPrinter {
    pub fn new(quiet: bool, stream: Option<super::stream::TextStream>, gen: usize) -> Self {
        StepPrinter {
            quiet,
            stream,
            gen,
            started: None,
            steps: 0,
            disk: None,
            last_ticks: Vec::new(),
            disk_busy: Vec::new(),
        }
    }

    /// Measure how busy the disks under `paths` are during each step (see [`super::disk`]).
    pub fn watch_disks(mut self, paths: &[&Path]) -> Self {
        self.disk = super::disk::DiskBusy::of(paths);
        self
    }

    /// The devices watched, comma-separated (None: none could be).
    pub fn disk_names(&self) -> Option<String> {
        self.disk.as_ref().map(|d| d.names())
    }

    fn line(&mut self, s: &StepStats) {
        self.steps += 1;
        if let Some(d) = &self.disk {
            let now = d.sample();
            self.disk_busy
                .push(super::disk::DiskBusy::busy_seconds(&self.last_ticks, &now));
            self.last_ticks = now;
        }
        if self.quiet {
            return;
        }
        let line = report::step_line(&report::to_step_report(s));
        let eta = match self.started {
            Some(t0) if self.gen > self.steps => {
                let per = t0.elapsed().as_secs_f64() / self.steps as f64;
                format!("  (eta {:.1} s)", per * (self.gen - self.steps) as f64)
            }
            _ => String::new(),
        };
        tracing::info!("{line}{eta}");
    }

    /// Print newly safe text; true when a stop string has ended the stream.
    fn text_bytes(&mut self, bytes: &[u8]) -> bool {
        let Some(st) = self.stream.as_mut() else {
            return false;
        };
        let t = st.push(bytes);
        if !t.is_empty() {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(t.as_bytes());
            let _ = out.flush();
        }
        st.stopped()
    }

    /// End of generation: the rest of the text and a final newline.
    pub fn finish(&mut self) {
        if let Some(st) = self.stream.as_mut() {
            use std::io::Write;
            let t = st.finish();
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(t.as_bytes());
            let _ = out.write_all(b"\n");
            let _ = out.flush();
        }
    }

    /// Tokens to keep when a stop string ended the text early.
    pub fn stopped_at(&self) -> Option<usize> {
        self.stream.as_ref().and_then(|s| s.stopped_at())
    }
}

impl Observer for StepPrinter {
    fn started(&mut self) {
        self.started = Some(std::time::Instant::now());
        if let Some(d) = &self.disk {
            self.last_ticks = d.sample();
        }
        if !self.quiet {
            tracing::info!("{}", report::step_header());
        }
    }
    fn step(&mut self, s: &StepStats) {
        self.line(s);
    }
    fn text(&mut self, bytes: &[u8]) {
        self.text_bytes(bytes);
    }
    fn stop_requested(&self) -> bool {
        self.stream.as_ref().is_some_and(|s| s.stopped())
    }
}

/// `--single-process`: the decode loop's hooks.
struct Direct<'a> {
    /// `K3_FLOOR=1`: the read floor probed before each decode step.
    floor: Option<super::floor::Floor<'a>>,
    printer: StepPrinter,
    tok: Option<std::sync::Arc<k3_tokenizer::Tokenizer>>,
    steps: Vec<StepStats>,
    failures: u64,
    stop: bool,
}

impl StepHooks for Direct<'_> {
    type Error = std::convert::Infallible;

    fn before_step(&mut self, step: usize) {
        // Step 0 is the prompt's forward; the floor is a decode token's.
        if let Some(f) = self.floor.as_ref().filter(|_| step > 0) {
            f.probe(step);
        }
    }
    fn on_step(&mut self, s: Step<'_>) -> Result<(), Self::Error> {
        self.failures += s.out.stats.expert_failures as u64;
        let st = StepStats {
            step: s.step as u32,
            token: s.token,
            seconds: s.seconds,
            expert_requests: s.out.stats.expert_requests as u64,
            expert_failures: s.out.stats.expert_failures as u64,
            ..Default::default()
        };
        self.printer.line(&st);
        self.steps.push(st);
        if let Some(tok) = &self.tok {
            let bytes = tok
                .token_bytes(s.token)
                .map(<[u8]>::to_vec)
                .unwrap_or_else(|_| format!("<|bad_id_{}|>", s.token).into_bytes());
            self.stop = self.printer.text_bytes(&bytes);
        }
        Ok(())
    }
    fn done(&mut self) -> bool {
        self.stop
    }
}

/// The chat request the tokenizer renders for `--chat` (options from `--effort` and
/// `--no-thinking`).
pub fn chat_request_json(a: &GenArgs, text: &str) -> String {
    serde_json::json!({
        "messages": [{"role": "user", "content": text}],
        "thinking": a.chat_flags.thinking,
        "thinking_effort": a.chat_flags.effort,
        "add_generation_prompt": true,
    })
    .to_string()
}

/// The prompt's ids, encoded here (single-process mode has no tokenizer stage).
pub(crate) fn encode_locally(
    a: &GenArgs,
    tok: &k3_tokenizer::Tokenizer,
) -> Result<Vec<u32>, GenError> {
    let bytes = match &a.prompt {
        Prompt::Ids(ids) => return Ok(ids.clone()),
        Prompt::Text(t) => t.clone().into_bytes(),
        Prompt::File(p) => read_prompt_file(p)?,
    };
    if a.chat {
        let t = String::from_utf8(bytes).map_err(|_| GenError::NotUtf8 {
            what: "the prompt".into(),
        })?;
        return k3_tokenizer::chat::encode_chat_json(tok, &chat_request_json(a, &t))
            .map_err(GenError::Chat);
    }
    Ok(tok.encode_bytes(&bytes, false))
}

/// The bytes of `--prompt-file` (capped, a regular file).
fn read_prompt_file(p: &Path) -> Result<Vec<u8>, GenError> {
    k3_io::input::read_capped(p, k3_io::input::PROMPT_CAP).map_err(|source| GenError::PromptFile {
        path: p.to_path_buf(),
        source,
    })
}

/// `--single-process`: the forward called directly over mmapped shards.
pub fn single_process(c: &Common<'_>) -> Result<Generated, GenError> {
    let a = c.args;
    let tok = c.tok.clone();
    let prompt = match (&a.prompt, &tok) {
        (Prompt::Ids(ids), _) => ids.clone(),
        (_, Some(t)) => encode_locally(a, t)?,
        (_, None) => return Err(GenError::NeedsTok),
    };
    let fp = state_fingerprint(c)?;
    k3_layer_compute::kernels::tuning::install(k3_layer_compute::kernels::tuning::from_env());
    let pool = k3_layer_compute::pool::build(c.threads)?;
    let mw = MmapWeights::open(&a.model_dir)?;
    populate_resident(&mw, c);
    let model = Model::new(
        c.cfg.clone(),
        SourceWeights::new(mw),
        ModelOptions {
            threads: c.threads,
            layers: a.layers,
            eps: None,
        },
    )?;
    let stream = tok
        .as_ref()
        .map(|_| super::stream::TextStream::new(&a.sampling.stop));
    let floor = super::floor::Floor::from_env(
        &model.weights().source,
        c.layers,
        c.cfg.num_experts_per_token,
    );
    let mut hooks = Direct {
        floor,
        printer: StepPrinter::new(a.quiet, stream, a.gen).watch_disks(&disk_paths(a)),
        tok,
        steps: Vec::new(),
        failures: 0,
        stop: false,
    };
    hooks.printer.started();
    if a.record_routes.is_some() {
        k3_layer_compute::routes::start(&model, c.config_path, &a.model_dir)
            .map_err(GenError::Fingerprint)?;
    }
    let load = a.load_state.as_deref().map(|p| (p, fp.as_str()));
    let mut start = Start::new(&model, load, &prompt)?;
    let generated = pool.install(|| {
        decode_resumed(
            &model,
            &mut start.session,
            &Resume {
                history: &start.history,
                first_step: start.first_step,
            },
            &LoopOptions {
                prompt: &start.prompt,
                gen: a.gen,
                incremental: a.incremental,
                sampler: c.sampler,
                stop_ids: &c.stop_ids,
                dump_logits: a.dump_logits.as_deref(),
                prefill_chunk: None,
            },
            &mut hooks,
        )
    })?;
    hooks.printer.finish();
    if let Some(p) = &a.save_state {
        start.save(p, &fp, &generated)?;
    }
    if let Some(p) = &a.record_routes {
        k3_layer_compute::routes::finish(&model, p)?;
    }
    let text = hooks.printer.stream.as_ref().map(|s| s.text().into_bytes());
    Ok(Generated {
        prompt_ids: prompt,
        generated,
        steps: hooks.steps,
        text,
        expert_failures: hooks.failures,
        notes: state_notes(a),
        disks: hooks.printer.disk_names(),
        disk_busy: hooks.printer.disk_busy,
        ..Default::default()
    })
}

/// The directories a run reads weights from: the model's shards, the packed trunk and the
/// packed experts' drives.
fn disk_paths(a: &GenArgs) -> Vec<&Path> {
    let mut v = vec![a.model_dir.as_path()];
    v.extend(a.trunk_dirs());
    v.extend(a.experts.iter().map(PathBuf::as_path));
    v
}

/// The model's fingerprint for `--save-state` / `--load-state` (empty without them); a
/// state file of another model, version or with a bad checksum is refused here (exit 2),
/// and so is a `--save-state` path that cannot be written.
fn state_fingerprint(c: &Common<'_>) -> Result<String, GenError> {
    use k3_layer_compute::state::{self, StateError};
    let a = c.args;
    if a.save_state.is_none() && a.load_state.is_none() {
        return Ok(String::new());
    }
    let fp =
        state::fingerprint(c.config_path, &a.model_dir, c.layers).map_err(GenError::Fingerprint)?;
    if let Some(p) = &a.load_state {
        let bytes = state::read(p).map_err(GenError::LoadState)?;
        let load = |e| {
            GenError::LoadState(StateError::Load {
                path: p.clone(),
                source: Box::new(e),
            })
        };
        let (_, payload) = state::check(&bytes, &fp).map_err(load)?;
        // An id outside the vocabulary is refused here (exit 2), not in the stage.
        let vocab = c.cfg.vocab_size;
        if let Some(t) = state::tokens(payload)
            .map_err(load)?
            .into_iter()
            .find(|&t| t as usize >= vocab)
        {
            return Err(load(StateError::Mismatch(format!(
                "the state holds id {t}, outside the vocabulary (vocab_size {vocab})"
            ))));
        }
    }
    if let Some(p) = &a.save_state {
        let dir = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if p.is_dir() || !dir.is_dir() {
            return Err(GenError::SaveStatePath(p.clone()));
        }
    }
    Ok(fp)
}

fn state_notes(a: &GenArgs) -> Vec<String> {
    let mut n = Vec::new();
    if let Some(p) = &a.load_state {
        n.push(format!("continued from the saved state {}", p.display()));
    }
    if let Some(p) = &a.save_state {
        n.push(format!("session state saved to {}", p.display()));
    }
    n
}

/// The prompt as the tokenizer stage is asked to encode it (None: ids were given).
fn prompt_message(a: &GenArgs) -> Result<Option<Msg>, GenError> {
    let chat = |t: &str| Msg::EncodeChat {
        req: 1,
        chat_json: chat_request_json(a, t),
    };
    Ok(match &a.prompt {
        Prompt::Ids(_) => None,
        Prompt::Text(t) if a.chat => Some(chat(t)),
        Prompt::Text(t) => Some(Msg::EncodeText {
            req: 1,
            text: t.clone(),
            allow_specials: false,
        }),
        Prompt::File(p) => {
            let bytes = read_prompt_file(p)?;
            if a.chat {
                let t = String::from_utf8(bytes).map_err(|_| GenError::NotUtf8 {
                    what: format!("--prompt-file {}", p.display()),
                })?;
                Some(chat(&t))
            } else {
                Some(Msg::EncodeBytes {
                    req: 1,
                    bytes,
                    allow_specials: false,
                })
            }
        }
    })
}

/// Per-stage cgroup budgets: the plan's bytes for the stage plus headroom.
/// Environment variable of the budget test hook (see `budget_override`).
pub const BUDGET_OVERRIDE_ENV: &str = "K3_STAGE_BUDGET_OVERRIDE";
/// Environment variable that arms the test hooks; without `=1` a hook is refused.
pub const TEST_HOOKS_ENV: &str = "K3_TEST_HOOKS";

/// Budgets a test hook replaces, and the banner that says so.
type BudgetOverride = (Vec<(Stage, u64)>, String);

/// The test hook `K3_STAGE_BUDGET_OVERRIDE=stage=bytes,...` (tests/e2e/faults.rs puts a stage
/// over its budget to test the OOM path). It replaces cgroup budgets, so it is never taken
/// silently: it is honoured only with `K3_TEST_HOOKS=1` (else the run is refused, exit 2, so
/// a stray value in a user's shell cannot shrink a budget unseen), a malformed entry is
/// refused, and a run that honours it says so on stderr and in the report's notes.
fn budget_override(value: Option<String>, armed: bool) -> Result<Option<BudgetOverride>, GenError> {
    let Some(v) = value else {
        return Ok(None);
    };
    if !armed {
        return Err(GenError::HookNotArmed(BUDGET_OVERRIDE_ENV));
    }
    let mut out = Vec::new();
    for part in v.split(',').filter(|p| !p.trim().is_empty()) {
        let parsed = part
            .split_once('=')
            .and_then(|(s, b)| Some((Stage::parse(s.trim())?, b.trim().parse::<u64>().ok()?)));
        match parsed {
            Some((s, b)) if s != Stage::Orchestrator => out.push((s, b)),
            _ => return Err(GenError::BadBudgetOverride(part.to_string())),
        }
    }
    let what: Vec<String> = out.iter().map(|(s, b)| format!("{s}={b} bytes")).collect();
    let banner = format!(
        "TEST HOOK {BUDGET_OVERRIDE_ENV} replaced cgroup budgets: {}",
        what.join(", ")
    );
    Ok(Some((out, banner)))
}

fn stage_budgets(plan: &RunPlan) -> Result<(HashMap<Stage, u64>, Option<String>), GenError> {
    let mp = &plan.memory;
    // Each stage's cgroup gets its plan items plus headroom for what the plan cannot count
    // exactly (heap growth, page tables). Under one total budget (`--mem-gb`, auto, the
    // default) the headroom comes out of what the plan left of the limit (the reserve, at
    // least), so the stage limits add up to the limit rather than to it plus 1.8 GB.
    let (headroom, extra) = match plan.limit {
        Some(t) => {
            let slack = t.saturating_sub(mp.total_bytes) / 5;
            (slack.clamp(8 << 20, 256 << 20), slack.min(512 << 20))
        }
        None => (256u64 << 20, 512u64 << 20),
    };
    let mut budgets = HashMap::new();
    budgets.insert(
        Stage::TrunkLoader,
        mp.stage_bytes("trunk-loader") + headroom,
    );
    budgets.insert(
        Stage::ExpertFetcher,
        mp.stage_bytes("expert-fetcher") + headroom,
    );
    budgets.insert(
        Stage::LayerCompute,
        mp.stage_bytes("layer-compute") + headroom + extra,
    );
    budgets.insert(Stage::Tokenizer, headroom + extra.min(256 << 20));
    let hook = budget_override(
        std::env::var(BUDGET_OVERRIDE_ENV).ok(),
        std::env::var(TEST_HOOKS_ENV).as_deref() == Ok("1"),
    )?;
    let banner = hook.map(|(pairs, banner)| {
        budgets.extend(pairs);
        tracing::warn!("k3-orch: {banner}");
        banner
    });
    Ok((budgets, banner))
}

/// Environment variable of the expert-failure test hook ([`injected_failures`]).
pub const INJECT_ENV: &str = "K3_INJECT_EXPERT_FAILURES";
/// Environment variable of the drive-failure test hook ([`injected_drive_failures`]).
pub const INJECT_DRIVE_ENV: &str = "K3_INJECT_DRIVE_FAILURE";
/// Environment variable of the load-delay test hook: the trunk-loader stage says it is
/// ready this many ms after its load (read by the stage; `serve`'s 503-while-loading test).
pub const LOAD_DELAY_ENV: &str = "K3_TEST_LOAD_DELAY_MS";
/// Environment variable of the restart-backoff test hook: `serve` waits this many ms
/// instead of 500 before its first try to start failed stages again, doubling as before
/// (read by `serve::engine`; the test of failed restarts reported on `/health`).
pub const RESTART_BACKOFF_ENV: &str = "K3_TEST_RESTART_BACKOFF_MS";

/// Directories whose files' reads all fail, as if their drive failed
/// (`K3_INJECT_DRIVE_FAILURE=DIR,...`, the tests of exit 4 naming the drive; armed by
/// `K3_TEST_HOOKS=1`, [`check_test_hooks`]).
fn injected_drive_failures() -> Vec<PathBuf> {
    std::env::var_os(INJECT_DRIVE_ENV)
        .map(|v| {
            v.to_string_lossy()
                .split(',')
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .collect()
        })
        .unwrap_or_default()
}

/// The test hooks other than the budget override (which [`budget_override`] checks), each
/// refused up front (exit 2) unless `K3_TEST_HOOKS=1` arms it, and refused when malformed:
/// a stray variable in a user's shell never changes a run unseen, and a test that means to
/// use a hook never runs without it. Called where every run, `serve` and `chat` open the
/// model (`run::open_model`).
pub fn check_test_hooks() -> Result<(), GenError> {
    use super::plan::{LM_HEAD_CHUNK_ENV, LM_HEAD_HELD_ENV, PREFILL_CHUNK_ENV};
    let armed = std::env::var(TEST_HOOKS_ENV).as_deref() == Ok("1");
    for name in [
        INJECT_ENV,
        INJECT_DRIVE_ENV,
        PREFILL_CHUNK_ENV,
        LM_HEAD_CHUNK_ENV,
        LM_HEAD_HELD_ENV,
        LOAD_DELAY_ENV,
        RESTART_BACKOFF_ENV,
    ] {
        if name == INJECT_ENV || name == INJECT_DRIVE_ENV {
            if std::env::var_os(name).is_some() && !armed {
                return Err(GenError::HookNotArmed(name));
            }
        } else {
            numeric_hook(name)?;
        }
    }
    injected_failures().map(|_| ())
}

/// A numeric test hook's value: None when `name` is unset; refused (exit 2) when it is set
/// without `K3_TEST_HOOKS=1` or is not a positive integer. [`check_test_hooks`] checks a
/// run's hooks with it; a tool with a hook of its own (`pack-trunk`) reads it so.
pub fn numeric_hook(name: &'static str) -> Result<Option<u64>, GenError> {
    let Some(v) = std::env::var_os(name) else {
        return Ok(None);
    };
    if std::env::var(TEST_HOOKS_ENV).as_deref() != Ok("1") {
        return Err(GenError::HookNotArmed(name));
    }
    v.to_str()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .filter(|&n| n > 0)
        .map(Some)
        .ok_or_else(|| GenError::BadHookValue {
            name,
            value: v.to_string_lossy().into_owned(),
        })
}

/// Routed experts whose reads fail on purpose (`K3_INJECT_EXPERT_FAILURES=layer:expert,...`,
/// the tests of exit 4; armed by `K3_TEST_HOOKS=1`, [`check_test_hooks`]). A malformed
/// value is a usage error, not silently ignored.
fn injected_failures() -> Result<Vec<(u32, u32)>, GenError> {
    let Ok(v) = std::env::var(INJECT_ENV) else {
        return Ok(Vec::new());
    };
    v.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.split_once(':')
                .and_then(|(l, e)| Some((l.trim().parse().ok()?, e.trim().parse().ok()?)))
                .ok_or_else(|| GenError::BadInjection {
                    value: v.clone(),
                    part: p.to_string(),
                })
        })
        .collect()
}

/// The memory plan of `serve` and `chat` in one process (`--single-process`): the same
/// slots as [`warm_launch`] plans, without the stages; logged, refused up front (exit 2)
/// when it does not fit.
pub fn serve_plan(a: &GenArgs, shape: &ServeShape) -> Result<ServePlan, GenError> {
    let (cfg, cat, layers) = super::open_model(a)?;
    let sizes = super::sizes::model_sizes(&cfg, &cat, layers);
    let (plan, sp) = super::plan::plan_serve(a, shape, &cfg, &sizes, layers)?;
    for n in &plan.notes {
        tracing::info!("k3-orch: {n}");
    }
    tracing::info!("{}", plan.memory.render().trim_end());
    Ok(sp)
}

/// The pipeline `serve` and `chat` keep warm: the memory plan of `shape`'s slots
/// ([`super::plan::plan_serve`]) and every stage's configuration for the generation flags
/// `a` (its prompt and `--gen` are not used; each request brings its own, stop ids
/// included, so the tokenizer is not loaded here: the serve engine loads it once);
/// compute holds at most `max_queue` requests waiting for a slot. The plan's chunk and
/// prefix bytes come back with it.
pub fn warm_launch(
    a: &GenArgs,
    shape: &ServeShape,
    max_queue: usize,
) -> Result<(Launch, ServePlan), GenError> {
    let (cfg, cat, layers) = super::open_model(a)?;
    let config_path = super::config_path(a);
    let sizes = super::sizes::model_sizes(&cfg, &cat, layers);
    let (plan, sp) = super::plan::plan_serve(a, shape, &cfg, &sizes, layers)?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let common = Common {
        args: a,
        cfg: &cfg,
        config_path: &config_path,
        layers,
        plan: &plan,
        threads,
        sampler: SamplerConfig::default(),
        // Unused by a warm compute: every Generate request carries its stop ids.
        stop_ids: Vec::new(),
        tok: None,
    };
    let (mut launch, _, banner) = launch_of(&common)?;
    launch.compute.warm = true;
    // Between requests nothing streams: the ring may read the next request's first part
    // while it waits, instead of when that request starts.
    launch.trunk.hold_wrap = false;
    // Prompts are fed in chunks the plan sized compute's scratch for
    // ([`super::plan::plan_serve`]). A chunk's experts may outnumber the fetcher's slots:
    // the union of its rows' routes streams through them, each expert read once per pass
    // and its slot reused as compute gives it back (as a one-shot prompt does). Passes of
    // one token each (the slots' share, as fed before) read the trunk and the experts once
    // per prompt token: at 5.5 GB on the slice a 16-token prompt took 16 passes.
    tracing::info!(
        "k3-orch: prompts are fed in passes of at most {} token(s) ({} expert slots)",
        sp.chunk,
        plan.min_slots
    );
    launch.compute.prefill_chunk = Some(sp.chunk);
    launch.compute.slots = conf::WarmSlots {
        slots: shape.slots,
        max_queue,
        ctx: shape.ctx,
        prefix_bytes: sp.prefix_bytes,
    };
    // (The plan's note on the ring's hold is a one-shot run's: see above.)
    for n in plan
        .notes
        .iter()
        .filter(|n| !n.starts_with("trunk ring:"))
        .chain(&banner)
    {
        tracing::info!("k3-orch: {n}");
    }
    tracing::info!("{}", plan.memory.render().trim_end());
    Ok((launch, sp))
}

/// `--single-process` at load: prefault the page tables of the weights the plan keeps
/// resident and every token multiplies ([`MmapWeights::populate`], as llama.cpp's
/// `MAP_POPULATE`): the trunk unless it streams, the lm_head unless it streams, and the
/// routed experts when the expert cache holds every one of them. Never the token
/// embedding (one row per token is read) nor layers past `--layers`. The first forward
/// then takes no page fault per 64 KiB of weights; the load takes that time instead.
fn populate_resident(mw: &MmapWeights, c: &Common<'_>) {
    use k3_model::classify::{classify, layer_of, TensorClass};
    let plan = &c.plan;
    let bound = |name: &str| layer_of(name).is_none_or(|l| l < c.layers);
    // The routed experts of the bound layers: those the cache would have to hold.
    let experts: u64 = mw
        .catalog()
        .iter()
        .filter(|(n, _)| bound(n) && classify(n) == TensorClass::RoutedExpert)
        .map(|(_, e)| e.len)
        .sum();
    let all_experts = plan.cache_budget >= experts;
    let keep = |name: &str| {
        if !bound(name) {
            return false;
        }
        match classify(name) {
            TensorClass::Vision => false,
            TensorClass::RoutedExpert => all_experts,
            TensorClass::Embedding => {
                name.contains("lm_head") && plan.lm_head_chunk_bytes.is_none()
            }
            _ => !plan.memory.trunk_streamed,
        }
    };
    let t0 = std::time::Instant::now();
    match mw.populate(keep) {
        Ok(bytes) if bytes > 0 => tracing::info!(
            "k3-orch: mapped {:.2} GB of resident weights in {:.2} s",
            bytes as f64 / 1e9,
            t0.elapsed().as_secs_f64()
        ),
        Ok(_) => {}
        // Only a hint: an older kernel without MADV_POPULATE_READ faults the pages in later.
        Err(e) => tracing::debug!("k3-orch: populate not applied: {e}"),
    }
}

/// A run's stage configuration, its cgroup budgets and the test-hook banner.
type LaunchOf = (Launch, HashMap<Stage, u64>, Option<String>);

/// Every stage's configuration for a run; the budgets and the test-hook banner.
fn launch_of(c: &Common<'_>) -> Result<LaunchOf, GenError> {
    let a = c.args;
    let (budgets, hook_banner) = stage_budgets(c.plan)?;
    let launch = Launch {
        mode: if a.inproc {
            Mode::Threads
        } else {
            Mode::Processes
        },
        tokenizer: conf::TokenizerConf {
            tok_dir: a.tok.clone(),
            record_dir: a.record.clone(),
        },
        trunk: conf::TrunkConf {
            model_dir: a.model_dir.clone(),
            trunk_dir: a.trunk.clone(),
            trunk_copies: a.trunk_copies.clone(),
            budget_bytes: c.plan.trunk_budget,
            layers: c.layers,
            record_dir: a.record.clone(),
            sink_bytes: c.plan.trunk_sink,
            decode_weight_ppm: c.plan.trunk_decode_ppm,
            hold_wrap: c.plan.trunk_hold_wrap,
            trunk_resident: a.trunk_resident,
        },
        fetcher: conf::FetcherConf {
            model_dir: a.model_dir.clone(),
            cache_bytes: c.plan.cache_budget,
            min_slots: c.plan.min_slots,
            max_slots: c.plan.max_slots,
            readers: 16,
            inject_failures: injected_failures()?,
            inject_drive_failures: injected_drive_failures(),
            experts_dirs: a.experts.clone(),
            trace_dir: a.dump_cache_trace.clone(),
            record_dir: a.record.clone(),
        },
        compute: conf::ComputeConf {
            model_dir: a.model_dir.clone(),
            config_path: c.config_path.to_path_buf(),
            layers: a.layers,
            prompt_ids: match &a.prompt {
                Prompt::Ids(ids) => ids.clone(),
                _ => Vec::new(),
            },
            gen: a.gen,
            incremental: a.incremental,
            sampler: c.sampler,
            threads: c.threads,
            dump_logits: a.dump_logits.clone(),
            io_timeout_s: a.stage_timeout_s,
            stop_ids: c.stop_ids.clone(),
            record_dir: a.record.clone(),
            lm_head_chunk_bytes: c.plan.lm_head_chunk_bytes,
            lm_head_held_bytes: c.plan.lm_head_held_bytes,
            lm_head_coded: if c.plan.lm_head_coded {
                a.trunk.clone()
            } else {
                None
            },
            lm_head_coded_copies: if c.plan.lm_head_coded {
                a.trunk_copies.clone()
            } else {
                Vec::new()
            },
            warm: false,
            load_state: a.load_state.clone(),
            save_state: a.save_state.clone(),
            state_fingerprint: state_fingerprint(c)?,
            prefill_chunk: c.plan.prefill_chunk,
            tuning: k3_layer_compute::kernels::tuning::from_env(),
            slots: conf::WarmSlots::default(),
            // The plan's arena slots against the bound layers' routed experts.
            speculate: a
                .speculate
                .resolve(c.plan.min_slots as u64, c.plan.max_slots as u64),
            record_routes: a.record_routes.clone(),
        },
        prompt: prompt_message(a)?,
        stage_timeout: std::time::Duration::from_secs_f64(a.stage_timeout_s),
        budgets: budgets.clone(),
        require_cgroups: a.require_cgroups,
        numa: a.numa.clone(),
        progress: !a.quiet,
    };
    Ok((launch, budgets, hook_banner))
}

/// The staged pipeline (four processes, or threads with `--inproc`).
pub fn staged(c: &Common<'_>) -> Result<Generated, GenError> {
    let a = c.args;
    let (launch, budgets, hook_banner) = launch_of(c)?;
    let stream = a
        .tok
        .as_ref()
        .map(|_| super::stream::TextStream::new(&a.sampling.stop));
    let mut printer = StepPrinter::new(a.quiet, stream, a.gen).watch_disks(&disk_paths(a));
    let mut out = supervise::run(&launch, &mut printer)?;
    printer.finish();
    let text = printer.stream.as_ref().map(|s| s.text().into_bytes());
    // A stop string ended the text: the ids end with the token that completed it. Compute
    // was told to stop there too; it may have finished a step or two more before it read
    // that, which are not part of the result.
    let mut stop_note = None;
    if let Some(k) = printer.stopped_at() {
        stop_note = Some(format!(
            "a stop string ended the output at token {k}; layer-compute stopped after {} of \
             --gen {} steps",
            out.steps.len(),
            a.gen
        ));
        out.generated.truncate(k);
        out.steps.truncate(k);
        printer.disk_busy.truncate(k);
    }
    let failures: u64 = out.steps.iter().map(|s| s.expert_failures).sum();
    let stages = Stage::WORKERS
        .iter()
        .map(|s| {
            let n = s.name().to_string();
            StageReport {
                name: n.clone(),
                pid: out.pids.get(&n).copied().unwrap_or(0),
                budget_bytes: budgets.get(s).copied(),
                cgroup: out.cgroups.get(&n).map(|c| c.0.clone()),
                peak_rss_bytes: out.peak_rss.get(&n).copied().unwrap_or(0),
                cgroup_peak_bytes: out.cgroups.get(&n).and_then(|c| c.2),
                numa: out.numa.get(&n).map(|x| format!("node {x}")),
            }
        })
        .collect();
    let mut notes = out.notes.clone();
    notes.extend(hook_banner);
    notes.extend(stop_note);
    notes.extend(state_notes(a));
    for (k, v) in &out.summaries {
        if let Some(r) = v.get("report").and_then(|r| r.as_str()) {
            notes.push(format!("{k}: {r}"));
        }
    }
    Ok(Generated {
        prompt_ids: out.prompt_ids,
        generated: out.generated,
        steps: out.steps,
        text,
        stages,
        notes,
        expert_failures: failures,
        summaries: out.summaries,
        disks: printer.disk_names(),
        disk_busy: printer.disk_busy,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Catches a hook that is taken silently: without K3_TEST_HOOKS=1 it is refused (exit 2),
    // never applied.
    #[test]
    fn budget_override_needs_the_arming_variable() {
        assert_eq!(budget_override(None, false).unwrap(), None);
        let e = budget_override(Some("layer-compute=1000000".into()), false).unwrap_err();
        assert!(matches!(e, GenError::HookNotArmed(_)), "{e}");
        let e = crate::error::RunError::from(e);
        assert_eq!(e.code, crate::error::EXIT_USAGE);
        assert!(e.msg.contains("K3_TEST_HOOKS=1"), "{}", e.msg);
    }

    // Catches malformed entries being skipped (the old parser dropped them silently).
    #[test]
    fn budget_override_refuses_malformed_entries() {
        for bad in [
            "layer-compute",
            "gpu=5",
            "layer-compute=lots",
            "orchestrator=1",
        ] {
            let e = budget_override(Some(bad.into()), true).unwrap_err();
            assert!(matches!(e, GenError::BadBudgetOverride(_)), "{bad}: {e}");
            assert_eq!(
                crate::error::RunError::from(e).code,
                crate::error::EXIT_USAGE,
                "{bad}"
            );
        }
    }

    // When armed it applies and names every replaced budget in its banner.
    #[test]
    fn budget_override_when_armed_has_a_banner() {
        let (pairs, banner) =
            budget_override(Some("layer-compute=1000000, tokenizer=5".into()), true)
                .unwrap()
                .unwrap();
        assert_eq!(
            pairs,
            vec![(Stage::LayerCompute, 1_000_000), (Stage::Tokenizer, 5)]
        );
        assert!(
            banner.starts_with("TEST HOOK K3_STAGE_BUDGET_OVERRIDE"),
            "{banner}"
        );
        assert!(banner.contains("layer-compute=1000000 bytes"), "{banner}");
    }
}
