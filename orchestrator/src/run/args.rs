//! The generation command line (`k3-orch <MODEL_DIR> [flags]`, docs/cli.md).
//!
//! Parsed by hand rather than with clap because the memory flags apply strictly left to
//! right (`--preset server --cache-gb 40` keeps the server trunk budget and overrides the
//! cache), which is the seed engine's contract and what its users' scripts rely on.
//!
//! Two layers, as ripgrep's flags (`crates/core/flags`): `LowArgs` is filled in order
//! from the command line, each value parsed and range-checked on its own; then
//! `GenArgs::from_low` fills in the defaults and checks the flags together (one prompt,
//! a tokenizer where text is involved, one mode, the context size). The defaults that look
//! at the model directory (the tokenizer files, `generation_config.json`) come through
//! [`ModelFiles`], so the parser itself is tested without files; they are the ones of
//! [`super::defaults`], which `chat` and `serve` share.

use std::path::{Path, PathBuf};

use super::defaults::{self, GenerationDefaults, Source};
use k3_protocol::conf::TrunkResident;

/// `--lm-head-read`: where a streamed lm_head's rows come from when the coded trunk codes
/// the lm_head (issue 37). Both serve compute the same rows; only the bytes read and the
/// decoding differ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HeadRead {
    /// Raw, from the checkpoint's shards.
    Raw,
    /// The coded lm_head's stored chunks, decoded by compute's reader threads.
    Coded,
    /// Whichever the plan weighs cheaper (raw without a coded lm_head).
    #[default]
    Auto,
}

impl HeadRead {
    /// The flag's value: `raw`, `coded` or `auto`.
    pub fn name(self) -> &'static str {
        match self {
            HeadRead::Raw => "raw",
            HeadRead::Coded => "coded",
            HeadRead::Auto => "auto",
        }
    }

    /// The mode a flag value names (None: not one of them).
    pub fn from_name(s: &str) -> Option<HeadRead> {
        [HeadRead::Raw, HeadRead::Coded, HeadRead::Auto]
            .into_iter()
            .find(|r| r.name() == s)
    }
}

/// Where the prompt comes from: exactly one of these.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    File(PathBuf),
    Ids(Vec<u32>),
}

/// One memory flag, in command-line order.
#[derive(Clone, Debug, PartialEq)]
pub enum MemFlag {
    Preset(String),
    TrunkGb(f64),
    CacheGb(f64),
    /// `--mem-gb`: one total budget for the whole run (issue 11).
    MemGb(f64),
}

/// Sampling options as given; greedy when no sampling flag is given (see
/// [`Sampling::resolve`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// Generation ends when the decoded text contains one of these (the text is cut before
    /// it; the ids end with the token that completed it).
    pub stop: Vec<String>,
}

/// How a `--chat` prompt is rendered: thinking on or off, and the thinking-effort message.
/// The default is [`defaults::thinking`]'s (thinking off), as in `chat` and `serve`.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatFlags {
    /// Thinking on (the prompt opens `think`); off, the prompt opens `response`.
    pub thinking: bool,
    /// `low`, `high`, `max`, or None (no effort message).
    pub effort: Option<String>,
}

impl Default for ChatFlags {
    fn default() -> Self {
        let (thinking, effort) = defaults::thinking(None, None);
        ChatFlags { thinking, effort }
    }
}

/// Parse an `--effort` value.
pub fn parse_effort(v: &str) -> Result<Option<String>, String> {
    match v {
        "none" => Ok(None),
        e if k3_tokenizer::chat::EFFORTS.contains(&e) => Ok(Some(e.to_string())),
        e => Err(format!("--effort {e:?}: expected low, high, max or none")),
    }
}

impl Sampling {
    /// The sampler configuration of a run. A filter (top-k, top-p, min-p) given without a
    /// temperature samples at temperature 1 (it is not silently greedy); `--temperature 0`
    /// is greedy whatever else is given. When the run samples and no seed was given, the
    /// seed is drawn at random (`random_seed`), and the caller prints and records it.
    pub fn resolve(&self, random_seed: impl FnOnce() -> u64) -> k3_protocol::conf::SamplerConfig {
        let filtered = self.top_k.is_some() || self.top_p.is_some() || self.min_p.is_some();
        let temperature = match self.temperature {
            Some(t) => Some(t),
            None if filtered => Some(1.0),
            None => None,
        };
        let mut cfg = k3_protocol::conf::SamplerConfig {
            temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: 0,
            ..Default::default()
        };
        cfg.seed = match self.seed {
            Some(s) => s,
            None if !cfg.is_greedy() => random_seed(),
            None => 0,
        };
        cfg
    }
}

impl Sampling {
    /// These flags over a model's `generation_config.json` values: each value a flag left
    /// unset is taken from the file, and every value says where it came from (the report's
    /// `sampling.sources`). The seed is a flag's or drawn ([`Sampling::resolve`]).
    pub fn over(&self, g: &GenerationDefaults) -> (Sampling, SamplingSources) {
        fn pick<T: Clone>(flag: &Option<T>, file: &Option<T>) -> (Option<T>, Source) {
            match (flag, file) {
                (Some(v), _) => (Some(v.clone()), Source::Flag),
                (None, Some(v)) => (Some(v.clone()), Source::GenerationConfig),
                (None, None) => (None, Source::BuiltIn),
            }
        }
        let (temperature, t) = pick(&self.temperature, &g.temperature);
        let (top_p, p) = pick(&self.top_p, &g.top_p);
        let (top_k, k) = pick(&self.top_k, &g.top_k);
        let (min_p, m) = pick(&self.min_p, &g.min_p);
        let (repetition_penalty, r) = pick(&self.repetition_penalty, &g.repetition_penalty);
        let seed = if self.seed.is_some() {
            Source::Flag
        } else {
            Source::BuiltIn
        };
        let s = Sampling {
            temperature,
            top_p,
            top_k,
            min_p,
            repetition_penalty,
            seed: self.seed,
            stop: self.stop.clone(),
        };
        let sources = SamplingSources(vec![
            ("temperature", t),
            ("top_p", p),
            ("top_k", k),
            ("min_p", m),
            ("repetition_penalty", r),
            ("seed", seed),
        ]);
        (s, sources)
    }
}

/// Where each sampling value of a run came from: a flag, the model's
/// `generation_config.json`, or k3's built-in default.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingSources(pub Vec<(&'static str, Source)>);

impl SamplingSources {
    /// As the report's `sampling.sources` object: `{"temperature": "flag", ...}`.
    pub fn to_json(&self) -> serde_json::Value {
        self.0
            .iter()
            .map(|(k, s)| ((*k).to_string(), serde_json::Value::from(s.as_str())))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }

    /// Where `key` came from.
    pub fn of(&self, key: &str) -> Option<Source> {
        self.0.iter().find(|(k, _)| *k == key).map(|(_, s)| *s)
    }
}

/// `--speculate`: reads before the router decides (issue 35). Never changes an id or a
/// logit bit; only when and what the expert-fetcher reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Speculate {
    On,
    Off,
    /// The default (measured: docs/measurements.md, issue 35). On when the routed experts
    /// stream (the expert cache holds fewer slots than the bound layers have routed
    /// experts); off when they all stay resident, where a guess can only cost compute time.
    #[default]
    Auto,
}

impl Speculate {
    /// Whether a run guesses: `expert_slots` is what the plan's expert cache holds,
    /// `routed` the routed experts of the bound layers.
    pub fn resolve(self, expert_slots: u64, routed: u64) -> bool {
        match self {
            Speculate::On => true,
            Speculate::Off => false,
            Speculate::Auto => expert_slots < routed,
        }
    }
}

/// A seed from the OS's randomness (for sampling runs given no `--seed`).
pub fn random_seed() -> u64 {
    rand::random::<u64>() >> 11 // 53 bits: exact in JSON numbers and JavaScript
}

/// Everything the generation command accepts.
#[derive(Clone, Debug, PartialEq)]
pub struct GenArgs {
    pub model_dir: PathBuf,
    pub prompt: Prompt,
    pub chat: bool,
    pub chat_flags: ChatFlags,
    /// The tokenizer directory: `--tok`, or the model directory when it holds the
    /// tokenizer files ([`defaults::tokenizer_dir`]); None: ids in, ids out.
    pub tok: Option<PathBuf>,
    pub mem: Vec<MemFlag>,
    pub trunk: Option<PathBuf>,
    /// `--trunk DIR,COPY,...`: copies of the packed trunk in `trunk` (the same trunk.json),
    /// each on a drive of its own; the trunk-loader spreads its reads over all of them.
    pub trunk_copies: Vec<PathBuf>,
    /// `--experts DIR,...`: the routed experts' pack (pack-experts), one directory per
    /// drive; empty: the experts are read from the shards.
    pub experts: Vec<PathBuf>,
    /// `--drive-gbps X`: the trunk drive's read rate, for weighing a coded trunk's decoding
    /// against its reads (None: measured at the start when the trunk is coded).
    pub drive_gbps: Option<f64>,
    /// `--decode-gbps X`: a coded trunk's decoding rate per core (None: measured on its
    /// own chunks at the start).
    pub decode_gbps: Option<f64>,
    /// `--trunk-resident raw|coded|auto`: how a coded trunk's resident layers are held
    /// (raw, kept coded and decoded on use, or whichever the plan weighs cheaper).
    pub trunk_resident: TrunkResident,
    /// `--lm-head-read raw|coded|auto`: where a streamed lm_head's rows are read from.
    pub lm_head_read: HeadRead,
    pub gen: usize,
    /// `-c/--ctx-size`: prompt plus generated tokens at most (refused up front beyond it).
    pub ctx_size: Option<usize>,
    /// Carry KV cache and recurrent state (the default); `--full-recompute` turns it off.
    pub incremental: bool,
    /// The sampling flags over the model's `generation_config.json` ([`Sampling::over`]).
    pub sampling: Sampling,
    /// Where each sampling value came from.
    pub sampling_sources: SamplingSources,
    pub config: Option<PathBuf>,
    pub layers: Option<usize>,
    /// The JSON report (`--out`); None: no report file is written.
    pub out: Option<PathBuf>,
    pub dump_logits: Option<PathBuf>,
    pub dump_cache_trace: Option<PathBuf>,
    /// `--speculate on|off|auto`: whether compute guesses each next layer's experts for
    /// the fetcher (`auto`: when the routed experts stream, [`Speculate::resolve`]).
    pub speculate: Speculate,
    /// `--record-routes FILE`: every token's routed experts per layer (k3_protocol::routes).
    pub record_routes: Option<PathBuf>,
    pub record: Option<PathBuf>,
    pub threads: Option<usize>,
    pub numa: Option<String>,
    pub inproc: bool,
    pub single_process: bool,
    pub require_cgroups: bool,
    pub stage_timeout_s: f64,
    pub quiet: bool,
    /// Write the session state after the run here (implies --incremental).
    pub save_state: Option<PathBuf>,
    /// Continue from this saved state (implies --incremental; the prompt is optional and
    /// follows the saved tokens).
    pub load_state: Option<PathBuf>,
    /// `--prompts F.jsonl`: one JSON string per line, each generated on its own (then
    /// `prompt` is empty); `--parallel` of them at once, prompts fed `--prefill-chunk`
    /// tokens per pass.
    pub prompts: Option<PathBuf>,
    pub parallel: usize,
    pub prefill_chunk: Option<usize>,
}

/// Most tokens one run may generate (the seed's ceiling).
pub const MAX_GEN: usize = 4096;
/// Longest prompt accepted, in tokens.
pub const MAX_PROMPT: usize = k3_protocol::conf::MAX_PROMPT_IDS;
/// `--stage-timeout` bounds, in seconds: a stage's timers add it to `Instant::now()`, so a
/// huge value (1e19, 1e30) would overflow them; a million seconds is eleven days.
pub const MIN_STAGE_TIMEOUT_S: f64 = 0.001;
pub const MAX_STAGE_TIMEOUT_S: f64 = 1e6;

/// What the parser found: a run, or a request answered without a model.
#[derive(Debug)]
pub enum Parsed {
    Run(Box<GenArgs>),
    Help,
    ListPresets,
}

pub const HELP: &str = "\
usage: k3-orch <MODEL_DIR> [prompt] [memory] [generation] [diagnostics]
       k3-orch -m MODEL_DIR -p TEXT [flags]             (llama.cpp's spelling)
       k3-orch chat <MODEL_DIR> --tok DIR               (interactive chat; chat --help)
       k3-orch serve <MODEL_DIR> --tok DIR [--port N]   (OpenAI-compatible server; serve --help)
       k3-orch project | doctor [MODEL_DIR]             (projected s/token; this machine's check)

model:
  MODEL_DIR, -m DIR, --model DIR
                         the checkpoint directory (config.json, shards; tokenizer files)
prompt (exactly one):
  --prompt TEXT, -p      tokenize TEXT
  --prompt-file PATH, -f, --file
                         tokenize the file's bytes verbatim
  --ids 1,2,3            token ids directly; no tokenizer is loaded unless --tok names one
  --chat                 wrap the prompt as one user turn in K3's XTML chat format
  --thinking             with --chat: open a `think` block (off by default; see docs/run-k3.md)
  --no-thinking          with --chat: open a `response` block (the default)
  --effort E             with --chat: thinking effort low|high|max|none (turns thinking on;
                         default max when thinking is on)
  --tok DIR              tiktoken.model + tokenizer_config.json (default: MODEL_DIR when it
                         holds them, as the release does; text prompts need one)
  --prompts F.jsonl      one JSON string per line, each a prompt of its own (needs a
                         tokenizer); one JSON line per prompt on stdout, each as a run
                         alone gives it
  --parallel N           with --prompts: generate N prompts at once (default 1)
  --prefill-chunk N      with --prompts: prompt tokens per pass (default: what fits, <= 256)
memory (applied left to right; a later flag wins):
  --preset NAME          laptop|desktop|workstation|server|max|auto (sets both budgets)
  --trunk DIR[,COPY...]  the packed trunk (pack-trunk); without it the trunk is loaded whole.
                         Each COPY holds a copy of DIR (cp -r) on a drive of its own: the
                         trunk's reads alternate over all of them, 8 MiB piece by piece
  --experts DIR[,DIR...] the packed routed experts (pack-experts --to DIR...), one directory
                         per drive, all of the pack (repeatable); read from every drive at once
  --mem-gb X             one total budget for the whole run, spent to read the fewest bytes
                         per token (default: MemAvailable/cgroup room minus a 5% reserve)
  --trunk-gb X           budget for pinned trunk layers plus the streaming ring
  --drive-gbps X         with a coded --trunk: the drive's read rate in GB/s, to weigh
                         decoding against reading (default: measured at the start)
  --decode-gbps X        with a coded --trunk: GB/s one core decodes (default: measured on
                         the trunk's own chunks at the start)
  --trunk-resident raw|coded|auto
                         with a coded --trunk: keep resident layers raw (decoded once),
                         coded (decoded on each use, ~1.45x more fit), or auto (default:
                         per layer, whichever the plan weighs cheaper; same ids)
  --lm-head-read raw|coded|auto
                         with a coded --trunk that codes the lm_head: read a streamed
                         lm_head raw from the checkpoint, coded from the trunk, or auto
                         (default: whichever the plan weighs cheaper; same ids)
  --cache-gb X           budget for the routed-expert cache
generation:
  --gen N, -n N, --n-predict N
                         tokens to generate (default 8, at most 4096)
  --ctx-size N, -c N     prompt plus generated tokens at most; more is refused (exit 2)
  --incremental          carry KV cache and recurrent state (the default)
  --full-recompute       recompute the whole prefix at every step (same ids, slower)
  --save-state FILE      write the session state (KV cache, KDA state) after the run
  --load-state FILE      continue from a saved state; the prompt is optional and follows it
                         (refused, exit 2, for another model, version or a bad checksum)
sampling (default: MODEL_DIR/generation_config.json's values when it has one, else greedy;
          a flag wins; the report's sampling.sources says where each value came from):
  --temperature T, --temp T
                         softmax temperature; 0 = greedy
  --top-k K              keep the K most likely ids
  --top-p P              keep the smallest set with probability >= P
  --min-p P              drop ids below P times the top id's probability
                         (top-k/top-p/min-p without a temperature sample at temperature 1)
  --repeat-penalty R, --repetition-penalty R
                         divide logits of ids in the last 64 tokens by R (also greedy)
  --seed S, -s S         seed of the draw; random (printed, recorded) when sampling without it
  --stop TEXT            end when the decoded text contains TEXT (repeatable; cut before it)
diagnostics:
  --config PATH          model config (default <MODEL_DIR>/config.json)
  --layers N             bind only layers 0..N-1
  --out FILE             write the JSON report to FILE (default: no report file)
  --dump-logits PATH     float32 LE logits of the first generation step
  --dump-cache-trace DIR expert_hist.json + expert_trace.bin (+ guess_trace.bin)
  --speculate on|off|auto  guess each next layer's experts and read them early into
                         slots no request needs; auto (default): when the
                         experts stream (same ids either way)
  --record-routes FILE   every token's routed experts per layer (for sim-cache, project --trace)
  --record DIR           record every stage's inbound messages and buffer hashes
  --threads N, -t N      compute threads (default: all cores)
  --numa SPEC            auto|off|stage=node,...
  --inproc               run the stages as threads in one process (same ids)
  --single-process       run the forward directly, without stages (same ids)
  --require-cgroups      fail when per-stage memory cgroups cannot be created
  --stage-timeout S      seconds a stage may stay silent before it is declared hung
                         (default 60; 0.001 to 1000000)
  --quiet, -q            only the generated text on stdout; warnings and errors on stderr
  -v, -vv, --verbose     debug / trace diagnostics on stderr (or K3_LOG=filter)
  --list-presets         the memory presets, with k3's projected s/token for each
  --help, -h             this text
exit codes: 0 ok; 1 bind/forward failure or a stage died; 2 usage, config or refused request;
            4 finished but a routed expert failed to load (ids unsound)
";

fn value<'a>(args: &'a [String], i: &mut usize, flag: &str) -> Result<&'a str, String> {
    *i += 1;
    args.get(*i)
        .map(|s| s.as_str())
        .ok_or_else(|| format!("{flag} needs a value"))
}

fn num<T: std::str::FromStr>(s: &str, flag: &str) -> Result<T, String> {
    s.trim()
        .parse::<T>()
        .map_err(|_| format!("{flag}: '{s}' is not a valid number"))
}

/// Parse a comma-separated id list ("1,2,3"); spaces around ids are allowed.
pub fn parse_ids(s: &str) -> Result<Vec<u32>, String> {
    let mut ids = Vec::new();
    for part in s.split(',') {
        let p = part.trim();
        if p.is_empty() {
            return Err(format!("--ids: empty entry in '{s}'"));
        }
        ids.push(
            p.parse::<u32>()
                .map_err(|_| format!("--ids: '{p}' is not a token id"))?,
        );
    }
    if ids.is_empty() {
        return Err("--ids: no ids given".into());
    }
    Ok(ids)
}

fn gb(s: &str, flag: &str) -> Result<f64, String> {
    let x: f64 = num(s, flag)?;
    if !x.is_finite() || x < 0.0 {
        return Err(format!("{flag}: '{s}' must be a non-negative number of GB"));
    }
    Ok(x)
}

/// `flag: value` as a rate in GB/s: a positive number.
fn rate(s: &str, flag: &str) -> Result<f64, String> {
    let x: f64 = num(s, flag)?;
    if !x.is_finite() || x <= 0.0 {
        return Err(format!("{flag}: '{s}' must be a positive number of GB/s"));
    }
    Ok(x)
}

/// The first of the parser's two layers (ripgrep's `LowArgs`): every flag as the command
/// line gave it, filled in order, each value parsed and range-checked on its own. Nothing
/// here looks at two flags together; [`GenArgs::from_low`] does.
#[derive(Debug, Default)]
struct LowArgs {
    /// Every model directory given (positional or `-m`; exactly one is wanted).
    model_dirs: Vec<PathBuf>,
    /// Every prompt flag given (exactly one is wanted).
    prompts: Vec<Prompt>,
    chat: bool,
    /// `--thinking` / `--no-thinking`, and `--effort` (`Some(None)`: "none"), as given.
    thinking: Option<bool>,
    effort: Option<Option<String>>,
    tok: Option<PathBuf>,
    mem: Vec<MemFlag>,
    trunk: Option<PathBuf>,
    trunk_copies: Vec<PathBuf>,
    experts: Vec<PathBuf>,
    drive_gbps: Option<f64>,
    decode_gbps: Option<f64>,
    trunk_resident: TrunkResident,
    lm_head_read: HeadRead,
    gen: Option<usize>,
    ctx_size: Option<usize>,
    incremental: bool,
    full_recompute: bool,
    sampling: Sampling,
    config: Option<PathBuf>,
    layers: Option<usize>,
    out: Option<PathBuf>,
    dump_logits: Option<PathBuf>,
    dump_cache_trace: Option<PathBuf>,
    speculate: Speculate,
    record_routes: Option<PathBuf>,
    record: Option<PathBuf>,
    threads: Option<usize>,
    numa: Option<String>,
    inproc: bool,
    single_process: bool,
    require_cgroups: bool,
    stage_timeout_s: Option<f64>,
    quiet: bool,
    save_state: Option<PathBuf>,
    load_state: Option<PathBuf>,
    prompts_file: Option<PathBuf>,
    parallel: Option<usize>,
    prefill_chunk: Option<usize>,
}

/// A flag's value, read when the flag wants one (`--flag=value` or the next argument).
type Val<'v> = dyn FnMut() -> Result<String, String> + 'v;

/// `flag: value` parsed as a number of `T` no smaller than `min` (and at most `max`).
fn count(v: &str, flag: &str, min: usize, max: usize) -> Result<usize, String> {
    let n: usize = num(v, flag)?;
    if n < min || n > max {
        return Err(if max == usize::MAX {
            format!("{flag}: must be at least {min}")
        } else {
            format!("{flag}: {n} is out of range ({min}..={max})")
        });
    }
    Ok(n)
}

impl LowArgs {
    /// Fill from `args` (without the program name), left to right. `--help` and
    /// `--list-presets` end the parse where they stand (Some).
    fn fill(&mut self, args: &[String]) -> Result<Option<Parsed>, String> {
        let mut i = 0;
        while i < args.len() {
            let arg = args[i].as_str();
            // Accept --flag=value as well as --flag value.
            let (flag, inline): (&str, Option<String>) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
                _ => (arg, None),
            };
            match flag {
                "--help" | "-h" => return Ok(Some(Parsed::Help)),
                "--list-presets" => return Ok(Some(Parsed::ListPresets)),
                _ => {}
            }
            let mut val = || match &inline {
                Some(v) => Ok(v.clone()),
                None => value(args, &mut i, flag).map(str::to_string),
            };
            let known = self.switch(flag)
                || self.prompt_flag(flag, &mut val)?
                || self.memory_flag(flag, &mut val)?
                || self.sampling_flag(flag, &mut val)?
                || self.run_flag(flag, &mut val)?;
            if !known {
                self.positional(flag, arg)?;
            }
            i += 1;
        }
        Ok(None)
    }

    /// A flag without a value; false for any other argument.
    fn switch(&mut self, flag: &str) -> bool {
        match flag {
            "--chat" => self.chat = true,
            "--thinking" => self.thinking = Some(true),
            "--no-thinking" => self.thinking = Some(false),
            "--incremental" => self.incremental = true,
            "--full-recompute" => self.full_recompute = true,
            "--inproc" => self.inproc = true,
            "--single-process" => self.single_process = true,
            "--require-cgroups" => self.require_cgroups = true,
            "--quiet" | "-q" => self.quiet = true,
            _ => return false,
        }
        true
    }

    /// The model, the prompt, the tokenizer and the chat wrapper's effort.
    fn prompt_flag(&mut self, flag: &str, val: &mut Val) -> Result<bool, String> {
        match flag {
            "--model" | "-m" => self.model_dirs.push(PathBuf::from(val()?)),
            "--prompt" | "-p" => self.prompts.push(Prompt::Text(val()?)),
            "--prompt-file" | "-f" | "--file" => {
                self.prompts.push(Prompt::File(PathBuf::from(val()?)))
            }
            "--ids" => self.prompts.push(Prompt::Ids(parse_ids(&val()?)?)),
            "--effort" => self.effort = Some(parse_effort(&val()?)?),
            "--tok" => self.tok = Some(PathBuf::from(val()?)),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The memory flags (kept in order: they apply left to right) and the packed trunk.
    fn memory_flag(&mut self, flag: &str, val: &mut Val) -> Result<bool, String> {
        match flag {
            "--preset" => {
                let p = val()?;
                match p.as_str() {
                    "laptop" | "desktop" | "workstation" | "server" | "max" | "auto" => {}
                    _ => {
                        return Err(format!(
                            "--preset: unknown preset '{p}' (laptop, desktop, workstation, server, max, auto)"
                        ))
                    }
                }
                self.mem.push(MemFlag::Preset(p));
            }
            "--trunk" => {
                let v = val()?;
                let mut dirs = v.split(',').filter(|d| !d.is_empty()).map(PathBuf::from);
                self.trunk = Some(
                    dirs.next()
                        .ok_or("--trunk: give the packed trunk's directory")?,
                );
                self.trunk_copies = dirs.collect();
            }
            "--experts" => {
                let v = val()?;
                let dirs: Vec<PathBuf> = v
                    .split(',')
                    .filter(|d| !d.is_empty())
                    .map(PathBuf::from)
                    .collect();
                if dirs.is_empty() {
                    return Err("--experts: give the pack's directories (DIR,DIR...)".into());
                }
                self.experts.extend(dirs);
            }
            "--trunk-gb" => self.mem.push(MemFlag::TrunkGb(gb(&val()?, flag)?)),
            "--cache-gb" => self.mem.push(MemFlag::CacheGb(gb(&val()?, flag)?)),
            "--mem-gb" => self.mem.push(MemFlag::MemGb(gb(&val()?, flag)?)),
            "--drive-gbps" => self.drive_gbps = Some(rate(&val()?, flag)?),
            "--decode-gbps" => self.decode_gbps = Some(rate(&val()?, flag)?),
            "--trunk-resident" => {
                let v = val()?;
                self.trunk_resident = TrunkResident::from_name(&v)
                    .ok_or_else(|| format!("--trunk-resident: '{v}' must be raw, coded or auto"))?;
            }
            "--lm-head-read" => {
                let v = val()?;
                self.lm_head_read = HeadRead::from_name(&v)
                    .ok_or_else(|| format!("--lm-head-read: '{v}' must be raw, coded or auto"))?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// How many tokens and how they are drawn.
    fn sampling_flag(&mut self, flag: &str, val: &mut Val) -> Result<bool, String> {
        let s = &mut self.sampling;
        match flag {
            "--gen" | "-n" | "--n-predict" => self.gen = Some(count(&val()?, flag, 1, MAX_GEN)?),
            "--ctx-size" | "-c" => self.ctx_size = Some(count(&val()?, flag, 1, usize::MAX)?),
            "--temperature" | "--temp" => {
                let t: f32 = num(&val()?, flag)?;
                if !t.is_finite() || t < 0.0 {
                    return Err(format!("{flag}: {t} must be >= 0"));
                }
                s.temperature = Some(t);
            }
            "--top-p" => {
                let p: f32 = num(&val()?, flag)?;
                if !(p > 0.0 && p <= 1.0) {
                    return Err(format!("--top-p: {p} must be in (0, 1]"));
                }
                s.top_p = Some(p);
            }
            "--top-k" => s.top_k = Some(count(&val()?, flag, 1, usize::MAX)?),
            "--min-p" => {
                let p: f32 = num(&val()?, flag)?;
                if !(0.0..=1.0).contains(&p) {
                    return Err(format!("--min-p: {p} must be in [0, 1]"));
                }
                s.min_p = Some(p);
            }
            "--repeat-penalty" | "--repetition-penalty" => {
                let r: f32 = num(&val()?, flag)?;
                if !(r.is_finite() && r > 0.0) {
                    return Err(format!("{flag}: {r} must be a positive number (1 = off)"));
                }
                s.repetition_penalty = Some(r);
            }
            "--stop" => {
                let t = val()?;
                if t.is_empty() {
                    return Err("--stop: the stop text must not be empty".into());
                }
                s.stop.push(t);
            }
            "--seed" | "-s" => s.seed = Some(num(&val()?, flag)?),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Where the run reads and writes, how it runs, the session state.
    fn run_flag(&mut self, flag: &str, val: &mut Val) -> Result<bool, String> {
        let path = |v: String| Some(PathBuf::from(v));
        match flag {
            "--config" => self.config = path(val()?),
            "--layers" => self.layers = Some(count(&val()?, flag, 1, usize::MAX)?),
            "--out" => self.out = path(val()?),
            "--dump-logits" => self.dump_logits = path(val()?),
            "--dump-cache-trace" => self.dump_cache_trace = path(val()?),
            "--speculate" => {
                self.speculate = match val()?.as_str() {
                    "on" => Speculate::On,
                    "off" => Speculate::Off,
                    "auto" => Speculate::Auto,
                    v => return Err(format!("--speculate: '{v}' must be on, off or auto")),
                }
            }
            "--record-routes" => self.record_routes = path(val()?),
            "--record" => self.record = path(val()?),
            "--threads" | "-t" => {
                let n: usize = num(&val()?, flag)?;
                if n == 0 || n > 1024 {
                    return Err(format!("--threads: {n} is out of range (1..=1024)"));
                }
                self.threads = Some(n);
            }
            "--numa" => self.numa = Some(val()?),
            "--stage-timeout" => {
                let s: f64 = num(&val()?, flag)?;
                if !(MIN_STAGE_TIMEOUT_S..=MAX_STAGE_TIMEOUT_S).contains(&s) {
                    return Err(format!(
                        "--stage-timeout: {s} is out of range \
                         ({MIN_STAGE_TIMEOUT_S}..={MAX_STAGE_TIMEOUT_S} seconds)"
                    ));
                }
                self.stage_timeout_s = Some(s);
            }
            "--save-state" => self.save_state = path(val()?),
            "--load-state" => self.load_state = path(val()?),
            "--prompts" => self.prompts_file = path(val()?),
            "--parallel" => self.parallel = Some(count(&val()?, flag, 1, 1024)?),
            "--prefill-chunk" => self.prefill_chunk = Some(count(&val()?, flag, 1, MAX_PROMPT)?),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// An argument no flag took: an unknown flag, or the model directory (once).
    fn positional(&mut self, flag: &str, arg: &str) -> Result<(), String> {
        if flag.starts_with('-') {
            return Err(match nearest(flag, FLAGS) {
                Some(n) => format!("unknown flag '{flag}' (did you mean {n}?)"),
                None => format!("unknown flag '{flag}'"),
            });
        }
        if !self.model_dirs.is_empty() {
            return Err(format!(
                "unexpected argument '{arg}' (the model directory was already given)"
            ));
        }
        self.model_dirs.push(PathBuf::from(arg));
        Ok(())
    }
}

/// What the parser asks of the model directory for its defaults ([`super::defaults`]):
/// the files on disk for a run, a fake in the parser's tests.
pub trait ModelFiles {
    /// The tokenizer directory: `given` checked, or the model directory's (Err: usage).
    fn tokenizer_dir(
        &self,
        given: Option<&Path>,
        model_dir: &Path,
    ) -> Result<Option<PathBuf>, String>;
    /// The sampling defaults of the model directory's `generation_config.json`.
    fn generation_defaults(&self, model_dir: &Path) -> Result<GenerationDefaults, String>;
}

/// The model directory as it is on disk.
pub struct OnDisk;

impl ModelFiles for OnDisk {
    fn tokenizer_dir(
        &self,
        given: Option<&Path>,
        model_dir: &Path,
    ) -> Result<Option<PathBuf>, String> {
        defaults::tokenizer_dir(given, model_dir)
    }

    fn generation_defaults(&self, model_dir: &Path) -> Result<GenerationDefaults, String> {
        GenerationDefaults::of_model_dir(model_dir)
    }
}

/// Refuse a run whose prompt and generated tokens exceed `-c/--ctx-size` (exit 2).
pub fn check_ctx_size(ctx: Option<usize>, prompt_tokens: usize, gen: usize) -> Result<(), String> {
    match ctx {
        Some(c) if prompt_tokens + gen > c => Err(format!(
            "the prompt ({prompt_tokens} tokens) plus --gen {gen} is {} tokens, over \
             --ctx-size {c}: shorten the prompt, lower --gen or raise --ctx-size",
            prompt_tokens + gen
        )),
        _ => Ok(()),
    }
}

impl GenArgs {
    /// The packed trunk's directory and then its copies (`--trunk DIR,COPY,...`); none
    /// without `--trunk`.
    pub fn trunk_dirs(&self) -> impl Iterator<Item = &Path> {
        self.trunk
            .iter()
            .chain(&self.trunk_copies)
            .map(PathBuf::as_path)
    }

    /// The second layer (ripgrep's `HiArgs`): the run the flags describe, with the
    /// defaults filled in (`files`: the model directory's tokenizer and
    /// `generation_config.json`) and the flags checked together.
    fn from_low(low: LowArgs, files: &dyn ModelFiles) -> Result<GenArgs, String> {
        let mut dirs = low.model_dirs;
        let model_dir = match dirs.len() {
            0 => return Err("missing <MODEL_DIR> (or -m DIR)".into()),
            1 => dirs.pop().expect("one model directory"),
            _ => return Err("the model directory was given twice (MODEL_DIR and -m)".into()),
        };
        let prompt = one_prompt(
            low.prompts,
            low.load_state.is_some(),
            low.prompts_file.is_some(),
        )?;
        // Text in or out needs a tokenizer: the given one, or the model directory's. An
        // `--ids` run without `--tok` stays ids in, ids out (no tokenizer is loaded).
        let needs_tok = !matches!(prompt, Prompt::Ids(_))
            || low.chat
            || !low.sampling.stop.is_empty()
            || low.prompts_file.is_some();
        let tok = if needs_tok || low.tok.is_some() {
            files.tokenizer_dir(low.tok.as_deref(), &model_dir)?
        } else {
            None
        };
        if needs_tok && tok.is_none() {
            return Err(format!(
                "--prompt, --prompt-file, --prompts, --chat and --stop need a tokenizer: --tok DIR ({}), \
                 or those files in the model directory; to skip the tokenizer pass --ids",
                defaults::TOKENIZER_FILES.join(" + ")
            ));
        }
        if let Prompt::Ids(ids) = &prompt {
            if ids.len() > MAX_PROMPT {
                return Err(format!(
                    "prompt of {} ids exceeds the {MAX_PROMPT}-token limit",
                    ids.len()
                ));
            }
        }
        let chat_flags = chat_flags(low.chat, low.thinking, low.effort)?;
        if low.prompts_file.is_some() {
            if low.load_state.is_some() || low.save_state.is_some() {
                return Err(
                    "--prompts runs prompts on their own: no --load-state or --save-state".into(),
                );
            }
        } else if low.parallel.is_some() || low.prefill_chunk.is_some() {
            return Err("--parallel and --prefill-chunk go with --prompts F.jsonl".into());
        }
        if low.inproc && low.single_process {
            return Err(
                "--inproc and --single-process are different modes; give at most one".into(),
            );
        }
        // A state is the incremental session.
        let stateful = low.save_state.is_some() || low.load_state.is_some();
        if low.full_recompute && (low.incremental || stateful) {
            return Err(
                "--full-recompute carries no state: it goes with neither --incremental \
                 nor --save-state/--load-state"
                    .into(),
            );
        }
        let gen = low.gen.unwrap_or(8);
        if let Prompt::Ids(ids) = &prompt {
            check_ctx_size(low.ctx_size, ids.len(), gen)?;
        }
        let (sampling, sampling_sources) =
            low.sampling.over(&files.generation_defaults(&model_dir)?);
        Ok(GenArgs {
            model_dir,
            prompt,
            chat: low.chat,
            chat_flags,
            tok,
            mem: low.mem,
            trunk: low.trunk,
            trunk_copies: low.trunk_copies,
            experts: low.experts,
            drive_gbps: low.drive_gbps,
            decode_gbps: low.decode_gbps,
            trunk_resident: low.trunk_resident,
            lm_head_read: low.lm_head_read,
            gen,
            ctx_size: low.ctx_size,
            incremental: !low.full_recompute,
            sampling,
            sampling_sources,
            config: low.config,
            layers: low.layers,
            out: low.out,
            dump_logits: low.dump_logits,
            dump_cache_trace: low.dump_cache_trace,
            speculate: low.speculate,
            record_routes: low.record_routes,
            record: low.record,
            threads: low.threads,
            numa: low.numa,
            inproc: low.inproc,
            single_process: low.single_process,
            require_cgroups: low.require_cgroups,
            stage_timeout_s: low.stage_timeout_s.unwrap_or(60.0),
            quiet: low.quiet,
            save_state: low.save_state,
            load_state: low.load_state,
            prompts: low.prompts_file,
            parallel: low.parallel.unwrap_or(1),
            prefill_chunk: low.prefill_chunk,
        })
    }
}

/// The one prompt of a run (none after `--load-state`: the saved tokens are the prompt).
fn one_prompt(
    mut prompts: Vec<Prompt>,
    load_state: bool,
    prompts_file: bool,
) -> Result<Prompt, String> {
    match prompts.len() {
        0 if load_state || prompts_file => Ok(Prompt::Ids(Vec::new())),
        _ if prompts_file => Err("--prompts gives every prompt: give no other prompt flag".into()),
        0 => Err("no prompt: give exactly one of --prompt, --prompt-file, --ids".into()),
        1 => Ok(prompts.pop().expect("one prompt")),
        n => Err(format!(
            "{n} prompts given: give exactly one of --prompt, --prompt-file, --ids"
        )),
    }
}

/// The chat rendering of the thinking flags ([`defaults::thinking`]); they need `--chat`.
fn chat_flags(
    chat: bool,
    thinking: Option<bool>,
    effort: Option<Option<String>>,
) -> Result<ChatFlags, String> {
    if (thinking.is_some() || effort.is_some()) && !chat {
        return Err(
            "--thinking, --no-thinking and --effort shape the chat prompt; they need --chat".into(),
        );
    }
    if thinking == Some(false) && effort.is_some() {
        return Err("--effort sets how much to think; it contradicts --no-thinking".into());
    }
    let (thinking, effort) = defaults::thinking(thinking, effort);
    Ok(ChatFlags { thinking, effort })
}

/// Parse `args` (without the program name) in two layers: `LowArgs` filled in order,
/// then `GenArgs::from_low` with the model directory's defaults as they are on disk.
/// Errors are usage errors (exit 2).
pub fn parse(args: &[String]) -> Result<Parsed, String> {
    parse_with(args, &OnDisk)
}

/// [`parse`] with the model directory's defaults from `files`.
pub fn parse_with(args: &[String], files: &dyn ModelFiles) -> Result<Parsed, String> {
    let mut low = LowArgs::default();
    if let Some(special) = low.fill(args)? {
        return Ok(special);
    }
    Ok(Parsed::Run(Box::new(GenArgs::from_low(low, files)?)))
}

/// Every long flag the generation command knows (for "did you mean"; each is in [`HELP`]).
pub const FLAGS: &[&str] = &[
    "--model",
    "--prompt",
    "--prompt-file",
    "--file",
    "--ids",
    "--chat",
    "--thinking",
    "--no-thinking",
    "--effort",
    "--tok",
    "--preset",
    "--trunk",
    "--experts",
    "--mem-gb",
    "--trunk-gb",
    "--cache-gb",
    "--drive-gbps",
    "--decode-gbps",
    "--trunk-resident",
    "--lm-head-read",
    "--gen",
    "--n-predict",
    "--ctx-size",
    "--incremental",
    "--full-recompute",
    "--temperature",
    "--temp",
    "--top-p",
    "--top-k",
    "--min-p",
    "--repeat-penalty",
    "--repetition-penalty",
    "--seed",
    "--stop",
    "--config",
    "--layers",
    "--out",
    "--dump-logits",
    "--dump-cache-trace",
    "--speculate",
    "--record-routes",
    "--record",
    "--threads",
    "--numa",
    "--inproc",
    "--single-process",
    "--require-cgroups",
    "--stage-timeout",
    "--quiet",
    "--verbose",
    "--save-state",
    "--load-state",
    "--prompts",
    "--parallel",
    "--prefill-chunk",
    "--help",
    "--list-presets",
];

/// The short flags the generation command knows (each is in [`HELP`]).
pub const SHORT_FLAGS: &[&str] = &[
    "-m", "-p", "-f", "-n", "-c", "-s", "-t", "-q", "-v", "-vv", "-h",
];

/// Edit distance (Levenshtein) between two short strings.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The candidate closest to `word`, when it is close enough to be a likely typo (at most a
/// third of its length edited, and at most 3 edits).
pub fn nearest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let limit = (word.chars().count() / 3).clamp(1, 3);
    candidates
        .iter()
        .map(|c| (edit_distance(word, c), *c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model directory as the parser's tests want it: `t` and `m` are tokenizer
    /// directories (`m` is a model directory that holds one, as the release does), `bare`
    /// holds none; `sampled` has a generation_config.json with sampling values.
    struct Fake;

    impl ModelFiles for Fake {
        fn tokenizer_dir(
            &self,
            given: Option<&Path>,
            model_dir: &Path,
        ) -> Result<Option<PathBuf>, String> {
            let is_tok = |d: &Path| matches!(d.to_str(), Some("t" | "m" | "sampled"));
            match given {
                Some(d) if is_tok(d) => Ok(Some(d.to_path_buf())),
                Some(d) => Err(format!("--tok {}: no tiktoken.model there", d.display())),
                None if is_tok(model_dir) => Ok(Some(model_dir.to_path_buf())),
                None => Ok(None),
            }
        }

        fn generation_defaults(&self, model_dir: &Path) -> Result<GenerationDefaults, String> {
            match model_dir.to_str() {
                Some("sampled") => Ok(GenerationDefaults {
                    temperature: Some(0.6),
                    top_p: Some(0.95),
                    ..Default::default()
                }),
                Some("broken") => Err("broken/generation_config.json: not JSON".into()),
                _ => Ok(GenerationDefaults::default()),
            }
        }
    }

    fn p(s: &str) -> Result<Parsed, String> {
        let v: Vec<String> = s.split_whitespace().map(str::to_string).collect();
        parse_with(&v, &Fake)
    }

    fn run(s: &str) -> GenArgs {
        match p(s) {
            Ok(Parsed::Run(a)) => *a,
            other => panic!("expected a run for {s:?}, got {other:?}"),
        }
    }

    #[test]
    fn memory_flags_keep_their_order() {
        // A parser that resolved presets after the -gb flags would lose this order.
        let a = run("bare --preset server --cache-gb 40 --ids 1");
        assert_eq!(
            a.mem,
            vec![MemFlag::Preset("server".into()), MemFlag::CacheGb(40.0)]
        );
    }

    #[test]
    fn exactly_one_prompt() {
        assert!(p("bare").unwrap_err().contains("no prompt"));
        assert!(p("bare --ids 1 --ids 2").unwrap_err().contains("2 prompts"));
        assert!(p("bare --prompt hi").unwrap_err().contains("--tok"));
        assert!(p("bare --ids 1 --chat").unwrap_err().contains("--tok"));
        assert!(matches!(
            run("bare --prompt hi --tok t").prompt,
            Prompt::Text(ref s) if s == "hi"
        ));
    }

    #[test]
    fn bad_values_are_usage_errors() {
        assert!(p("bare --ids 1,x").is_err());
        assert!(p("bare --ids 1,,2").is_err());
        assert!(p("bare --ids 1 --gen 0").is_err());
        assert!(p("bare --ids 1 --gen 4097").is_err());
        assert!(p("bare --ids 1 --preset huge").is_err());
        assert!(p("bare --ids 1 --trunk-gb -1").is_err());
        assert!(p("bare --ids 1 --frobnicate").is_err());
        assert!(p("bare n --ids 1").is_err());
        assert!(p("--ids 1").unwrap_err().contains("MODEL_DIR"));
        assert!(p("bare --ids 1 --gen")
            .unwrap_err()
            .contains("needs a value"));
        assert!(p("bare --ids 1 --ctx-size 0").is_err());
    }

    /// The defaults a user expects (issue 34): incremental decoding, no report file unless
    /// --out names one, greedy without a generation_config.json.
    #[test]
    fn defaults_and_inline_values() {
        let a = run("bare --ids=5,6 --gen=3");
        assert_eq!(a.prompt, Prompt::Ids(vec![5, 6]));
        assert_eq!(a.gen, 3);
        assert_eq!(a.out, None, "nothing is written to the current directory");
        assert!(a.incremental, "incremental decoding is the default");
        assert_eq!(a.ctx_size, None);
        assert_eq!(a.tok, None);
        assert_eq!(
            run("bare --ids 1 --out r.json").out,
            Some(PathBuf::from("r.json"))
        );
        // --incremental stays accepted; --full-recompute is the old mode.
        assert!(run("bare --ids 1 --incremental").incremental);
        assert!(!run("bare --ids 1 --full-recompute").incremental);
        assert!(p("bare --ids 1 --full-recompute --incremental").is_err());
        assert!(p("bare --ids 1 --full-recompute --save-state s")
            .unwrap_err()
            .contains("--full-recompute"));
    }

    #[test]
    fn help_and_presets_need_no_model() {
        assert!(matches!(p("--help"), Ok(Parsed::Help)));
        assert!(matches!(p("--list-presets"), Ok(Parsed::ListPresets)));
    }

    #[test]
    fn llama_cpp_spellings_are_aliases() {
        let a = run("-m bare --ids 1 --temp 0.7 -n 5 -s 11 -t 2 -c 64");
        assert_eq!(a.model_dir, PathBuf::from("bare"));
        assert_eq!(a.sampling.temperature, Some(0.7));
        assert_eq!(a.gen, 5);
        assert_eq!(a.sampling.seed, Some(11));
        assert_eq!(a.threads, Some(2));
        assert_eq!(a.ctx_size, Some(64));
        assert_eq!(run("--model bare --ids 1 --n-predict 4").gen, 4);
        assert_eq!(run("--model=bare --ids 1 --ctx-size=9").ctx_size, Some(9));
        assert_eq!(run("bare -p hi --tok t").prompt, Prompt::Text("hi".into()));
        assert_eq!(
            run("bare --file f --tok t").prompt,
            Prompt::File("f".into())
        );
        assert!(p("bare -m bare --ids 1").unwrap_err().contains("twice"));
        assert!(p("-m bare bare --ids 1").is_err());
    }

    /// `-c/--ctx-size` refuses up front a prompt plus --gen that does not fit.
    #[test]
    fn ctx_size_refuses_up_front() {
        assert!(p("bare --ids 1,2,3 --gen 5 -c 8").is_ok());
        let e = p("bare --ids 1,2,3 --gen 6 -c 8").unwrap_err();
        assert!(e.contains("--ctx-size 8") && e.contains("9 tokens"), "{e}");
        assert!(check_ctx_size(None, 10_000, 4096).is_ok());
        assert!(check_ctx_size(Some(10), 5, 6).is_err());
    }

    /// `--tok` defaults to the model directory when the tokenizer files are there; a `--tok`
    /// without them is a usage error.
    #[test]
    fn tokenizer_defaults_to_the_model_directory() {
        let a = run("m --prompt hi");
        assert_eq!(a.tok, Some(PathBuf::from("m")));
        // ids in, ids out: no tokenizer unless one is named.
        assert_eq!(run("m --ids 1").tok, None);
        assert_eq!(run("m --ids 1 --tok t").tok, Some(PathBuf::from("t")));
        assert!(p("bare --ids 1 --tok nope").is_err());
        assert_eq!(run("m --prompt hi --tok t").tok, Some(PathBuf::from("t")));
        assert!(p("m --prompt hi --tok nope")
            .unwrap_err()
            .contains("tiktoken.model"));
        assert!(run("m --prompt hi --stop x").sampling.stop == vec!["x".to_string()]);
    }

    #[test]
    fn sampling_flags_and_resolution() {
        let a = run("bare --ids 1 --top-k 5");
        // top-k alone samples (temperature 1), with a random seed when none is given.
        let c = a.sampling.resolve(|| 77);
        assert_eq!(c.temperature, Some(1.0));
        assert_eq!(c.top_k, Some(5));
        assert_eq!(c.seed, 77);
        assert!(!c.is_greedy());
        // Greedy by default: no random seed is drawn.
        let g = run("bare --ids 1")
            .sampling
            .resolve(|| panic!("greedy draws no seed"));
        assert!(g.is_greedy());
        assert_eq!(g.seed, 0);
        // An explicit temperature 0 stays greedy; an explicit seed wins.
        let z = run("bare --ids 1 --temp 0 --top-k 5 --seed 3")
            .sampling
            .resolve(|| 1);
        assert!(z.is_greedy());
        assert_eq!(z.seed, 3);
        let m = run("bare --ids 1 --min-p 0.1 --repeat-penalty 1.3");
        let mc = m.sampling.resolve(|| 5);
        assert_eq!(mc.min_p, Some(0.1));
        assert_eq!(mc.repetition_penalty, Some(1.3));
        assert!(p("bare --ids 1 --min-p 2").is_err());
        assert!(p("bare --ids 1 --repeat-penalty 0").is_err());
        assert!(p("bare --ids 1 --stop x").unwrap_err().contains("--tok"));
        let s = run("bare --prompt hi --tok t --stop a --stop bc");
        assert_eq!(s.sampling.stop, vec!["a".to_string(), "bc".to_string()]);
    }

    /// The release's generation_config.json sets the sampling a flag does not, and the
    /// sources say which is which.
    #[test]
    fn generation_config_sets_the_default_sampling() {
        let a = run("sampled --ids 1");
        assert_eq!(a.sampling.temperature, Some(0.6));
        assert_eq!(a.sampling.top_p, Some(0.95));
        assert_eq!(a.sampling.top_k, None);
        let src = &a.sampling_sources;
        assert_eq!(src.of("temperature"), Some(Source::GenerationConfig));
        assert_eq!(src.of("top_k"), Some(Source::BuiltIn));
        assert_eq!(src.of("seed"), Some(Source::BuiltIn));
        let j = src.to_json();
        assert_eq!(j["top_p"], "generation_config");
        assert_eq!(j["min_p"], "built-in");
        // A flag wins, and --temp 0 is greedy whatever the file says.
        let b = run("sampled --ids 1 --temp 0 --seed 4");
        assert_eq!(b.sampling_sources.of("temperature"), Some(Source::Flag));
        assert_eq!(b.sampling_sources.of("seed"), Some(Source::Flag));
        assert!(b.sampling.resolve(|| 1).is_greedy());
        // Without the file every source is built in.
        let c = run("bare --ids 1");
        assert!(c
            .sampling_sources
            .0
            .iter()
            .all(|(_, s)| *s == Source::BuiltIn));
        assert!(p("broken --ids 1")
            .unwrap_err()
            .contains("generation_config"));
    }

    /// One thinking default (off) for run, chat and serve; `--thinking` or `--effort` turns
    /// it on, at effort max unless told.
    #[test]
    fn chat_thinking_is_off_by_default() {
        let a = run("bare --prompt hi --tok t --chat");
        assert!(!a.chat_flags.thinking);
        assert_eq!(a.chat_flags.effort, None);
        let t = run("bare --prompt hi --tok t --chat --thinking");
        assert!(t.chat_flags.thinking);
        assert_eq!(t.chat_flags.effort.as_deref(), Some("max"));
        let e = run("bare --prompt hi --tok t --chat --effort low");
        assert!(e.chat_flags.thinking);
        assert_eq!(e.chat_flags.effort.as_deref(), Some("low"));
        let n = run("bare --prompt hi --tok t --chat --effort none");
        assert!(n.chat_flags.thinking);
        assert_eq!(n.chat_flags.effort, None);
        assert!(
            !run("bare --prompt hi --tok t --chat --no-thinking")
                .chat_flags
                .thinking
        );
        assert!(p("bare --prompt hi --tok t --chat --effort medium").is_err());
        assert!(
            p("bare --prompt hi --tok t --chat --no-thinking --effort low")
                .unwrap_err()
                .contains("contradicts")
        );
        assert!(p("bare --prompt hi --tok t --no-thinking")
            .unwrap_err()
            .contains("--chat"));
        assert!(p("bare --prompt hi --tok t --thinking")
            .unwrap_err()
            .contains("--chat"));
    }

    /// Every flag the parser knows is in --help, and every flag listed is one it knows.
    #[test]
    fn every_flag_is_in_help() {
        for f in FLAGS.iter().chain(SHORT_FLAGS) {
            let listed = HELP
                .split(|c: char| c.is_whitespace() || c == ',')
                .any(|w| w == *f);
            assert!(listed, "{f} is not in --help");
            // -v/--verbose are taken off argv by the dispatcher, before this parser.
            if matches!(*f, "-v" | "-vv" | "--verbose") {
                continue;
            }
            let e = p(&format!("bare --ids 1 {f}")).err().unwrap_or_default();
            assert!(!e.contains("unknown flag"), "{f}: {e}");
        }
    }

    /// `--speculate auto` guesses exactly when the arena holds fewer slots than the bound
    /// layers have routed experts. Catches an `auto` that guesses over a resident cache
    /// (pure cost) or one that never guesses while experts stream, and a parser that takes
    /// an unknown mode for `off`.
    #[test]
    fn speculate_modes_parse_and_auto_follows_the_arena() {
        assert_eq!(run("bare --ids 1").speculate, Speculate::Auto);
        assert_eq!(
            run("bare --ids 1 --speculate off").speculate,
            Speculate::Off
        );
        assert_eq!(run("bare --ids 1 --speculate on").speculate, Speculate::On);
        assert_eq!(
            run("bare --ids 1 --speculate auto").speculate,
            Speculate::Auto
        );
        assert!(p("bare --ids 1 --speculate maybe")
            .unwrap_err()
            .contains("must be on, off or auto"));
        // The slice at 5.5 GB: 16 slots for 3 MoE layers x 64 experts; resident: all 192.
        assert!(Speculate::Auto.resolve(16, 192));
        assert!(!Speculate::Auto.resolve(192, 192));
        assert!(Speculate::On.resolve(192, 192));
        assert!(!Speculate::Off.resolve(16, 192));
    }

    /// `--lm-head-read` takes raw, coded or auto (the default) and refuses anything else.
    /// Catches a parser that takes an unknown mode for the default.
    #[test]
    fn lm_head_read_modes_parse() {
        assert_eq!(run("bare --ids 1").lm_head_read, HeadRead::Auto);
        for m in ["raw", "coded", "auto"] {
            let a = run(&format!("bare --ids 1 --lm-head-read {m}"));
            assert_eq!(a.lm_head_read.name(), m);
        }
        assert!(p("bare --ids 1 --lm-head-read zip")
            .unwrap_err()
            .contains("must be raw, coded or auto"));
    }

    /// `--trunk-resident` takes raw, coded or auto (the default) and refuses anything
    /// else. Catches a parser that takes an unknown mode for the default.
    #[test]
    fn trunk_resident_modes_parse() {
        assert_eq!(run("bare --ids 1").trunk_resident, TrunkResident::Auto);
        for m in ["raw", "coded", "auto"] {
            let a = run(&format!("bare --ids 1 --trunk-resident {m}"));
            assert_eq!(a.trunk_resident.name(), m);
        }
        assert!(p("bare --ids 1 --trunk-resident zip")
            .unwrap_err()
            .contains("must be raw, coded or auto"));
    }

    #[test]
    fn typos_get_a_suggestion() {
        assert!(p("bare --ids 1 --temprature 1")
            .unwrap_err()
            .contains("did you mean --temperature"));
        assert_eq!(nearest("inpsect", &["inspect", "verify"]), Some("inspect"));
        assert_eq!(nearest("zzzzzz", &["inspect", "verify"]), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
