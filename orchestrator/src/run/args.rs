//! The generation command line (`k3-orch <MODEL_DIR> [flags]`, docs/cli.md).
//!
//! Parsed by hand rather than with clap because the memory flags apply strictly left to
//! right (`--preset server --cache-gb 40` keeps the server trunk budget and overrides the
//! cache), which is the seed engine's contract and what its users' scripts rely on.
//!
//! Two layers, as ripgrep's flags (`crates/core/flags`): `LowArgs` is filled in order
//! from the command line, each value parsed and range-checked on its own; then
//! `GenArgs::from_low` fills in the defaults and checks the flags together (one prompt,
//! `--tok` where text is involved, one mode).

use std::path::PathBuf;

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

/// Chat rendering flags shared by generation and `tokenize --chat`.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatFlags {
    /// Thinking on (the prompt opens `think`); `--no-thinking` opens `response`.
    pub thinking: bool,
    /// `low`, `high`, `max`, or None (`--effort none`: no effort message).
    pub effort: Option<String>,
}

impl Default for ChatFlags {
    fn default() -> Self {
        ChatFlags {
            thinking: true,
            effort: Some("max".into()),
        }
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
        };
        cfg.seed = match self.seed {
            Some(s) => s,
            None if !cfg.is_greedy() => random_seed(),
            None => 0,
        };
        cfg
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
    pub tok: Option<PathBuf>,
    pub mem: Vec<MemFlag>,
    pub trunk: Option<PathBuf>,
    pub gen: usize,
    pub incremental: bool,
    pub sampling: Sampling,
    pub config: Option<PathBuf>,
    pub layers: Option<usize>,
    pub out: PathBuf,
    pub dump_logits: Option<PathBuf>,
    pub dump_cache_trace: Option<PathBuf>,
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

/// What the parser found: a run, or a request answered without a model.
#[derive(Debug)]
pub enum Parsed {
    Run(Box<GenArgs>),
    Help,
    ListPresets,
}

pub const HELP: &str = "\
usage: k3-orch <MODEL_DIR> [prompt] [memory] [generation] [diagnostics]
       k3-orch serve <MODEL_DIR> --tok DIR [--port N]   (OpenAI-compatible server; see --help)
       k3-orch chat <MODEL_DIR> --tok DIR               (interactive chat)

prompt (exactly one):
  --prompt TEXT, -p      tokenize TEXT (needs --tok)
  --prompt-file PATH, -f tokenize the file's bytes verbatim (needs --tok)
  --ids 1,2,3            token ids directly; no tokenizer is loaded
  --prompts F.jsonl      one JSON string per line, each a prompt of its own (needs --tok);
                         one JSON line per prompt on stdout, each as a run alone gives it
  --parallel N           with --prompts: generate N prompts at once (default 1)
  --prefill-chunk N      with --prompts: prompt tokens per pass (default: what fits, <= 256)
  --chat                 wrap the prompt as one user turn in K3's XTML chat format (needs --tok)
  --no-thinking          with --chat: open a `response` block instead of `think`
  --effort E             with --chat: thinking effort low|high|max|none (default max)
memory (applied left to right; a later flag wins):
  --preset NAME          laptop|desktop|workstation|server|max|auto (sets both budgets)
  --trunk DIR            the packed trunk (pack-trunk); without it the trunk is loaded whole
  --mem-gb X             one total budget for the whole run, spent to read the fewest bytes
                         per token (default: MemAvailable/cgroup room minus a 5% reserve)
  --trunk-gb X           budget for pinned trunk layers plus the streaming ring
  --cache-gb X           budget for the routed-expert cache
generation:
  --gen N, -n N          tokens to generate (default 8, at most 4096)
  --incremental          carry KV cache and recurrent state (same ids as full recompute)
  --tok DIR              tiktoken.model + tokenizer_config.json
  --save-state FILE      write the session state (KV cache, KDA state) after the run
  --load-state FILE      continue from a saved state; the prompt is optional and follows it
                         (refused, exit 2, for another model, version or a bad checksum)
sampling (greedy unless one of these is given):
  --temperature T, --temp T
                         softmax temperature; 0 = greedy
  --top-k K              keep the K most likely ids
  --top-p P              keep the smallest set with probability >= P
  --min-p P              drop ids below P times the top id's probability
                         (top-k/top-p/min-p without --temperature sample at temperature 1)
  --repeat-penalty R     divide logits of ids in the last 64 tokens by R (also greedy)
  --seed S, -s S         seed of the draw; random (printed, recorded) when sampling without it
  --stop TEXT            end when the decoded text contains TEXT (repeatable; cut before it)
diagnostics:
  --config PATH          model config (default <MODEL_DIR>/config.json)
  --layers N             bind only layers 0..N-1
  --out FILE             JSON report (default k3_run.json)
  --dump-logits PATH     float32 LE logits of the first generation step
  --dump-cache-trace DIR expert_hist.json + expert_trace.bin
  --record DIR           record every stage's inbound messages and buffer hashes
  --threads N, -t N      compute threads (default: all cores)
  --numa SPEC            auto|off|stage=node,...
  --inproc               run the stages as threads in one process (same ids)
  --single-process       run the forward directly, without stages (same ids)
  --require-cgroups      fail when per-stage memory cgroups cannot be created
  --stage-timeout S      seconds a stage may stay silent before it is declared hung (default 60)
  --quiet, -q            only the generated text on stdout; warnings and errors on stderr
  -v, -vv                debug / trace diagnostics on stderr (or K3_LOG=filter)
  --list-presets         the memory presets
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

/// The first of the parser's two layers (ripgrep's `LowArgs`): every flag as the command
/// line gave it, filled in order, each value parsed and range-checked on its own. Nothing
/// here looks at two flags together; [`GenArgs::from_low`] does.
#[derive(Debug, Default)]
struct LowArgs {
    model_dir: Option<PathBuf>,
    /// Every prompt flag given (exactly one is wanted).
    prompts: Vec<Prompt>,
    chat: bool,
    chat_flags: ChatFlags,
    tok: Option<PathBuf>,
    mem: Vec<MemFlag>,
    trunk: Option<PathBuf>,
    gen: Option<usize>,
    incremental: bool,
    sampling: Sampling,
    config: Option<PathBuf>,
    layers: Option<usize>,
    out: Option<PathBuf>,
    dump_logits: Option<PathBuf>,
    dump_cache_trace: Option<PathBuf>,
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
            "--no-thinking" => self.chat_flags.thinking = false,
            "--incremental" => self.incremental = true,
            "--inproc" => self.inproc = true,
            "--single-process" => self.single_process = true,
            "--require-cgroups" => self.require_cgroups = true,
            "--quiet" | "-q" => self.quiet = true,
            _ => return false,
        }
        true
    }

    /// The prompt, the tokenizer and the chat wrapper's effort.
    fn prompt_flag(&mut self, flag: &str, val: &mut Val) -> Result<bool, String> {
        match flag {
            "--prompt" | "-p" => self.prompts.push(Prompt::Text(val()?)),
            "--prompt-file" | "-f" => self.prompts.push(Prompt::File(PathBuf::from(val()?))),
            "--ids" => self.prompts.push(Prompt::Ids(parse_ids(&val()?)?)),
            "--effort" => self.chat_flags.effort = parse_effort(&val()?)?,
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
            "--trunk" => self.trunk = Some(PathBuf::from(val()?)),
            "--trunk-gb" => self.mem.push(MemFlag::TrunkGb(gb(&val()?, flag)?)),
            "--cache-gb" => self.mem.push(MemFlag::CacheGb(gb(&val()?, flag)?)),
            "--mem-gb" => self.mem.push(MemFlag::MemGb(gb(&val()?, flag)?)),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// How many tokens and how they are drawn.
    fn sampling_flag(&mut self, flag: &str, val: &mut Val) -> Result<bool, String> {
        let s = &mut self.sampling;
        match flag {
            "--gen" | "-n" | "--n-predict" => self.gen = Some(count(&val()?, flag, 1, MAX_GEN)?),
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
                if !(s > 0.0 && s.is_finite()) {
                    return Err("--stage-timeout: must be a positive number of seconds".into());
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
        if self.model_dir.is_some() {
            return Err(format!(
                "unexpected argument '{arg}' (the model directory was already given)"
            ));
        }
        self.model_dir = Some(PathBuf::from(arg));
        Ok(())
    }
}

impl GenArgs {
    /// The second layer (ripgrep's `HiArgs`): the run the flags describe, with the
    /// defaults filled in and the flags checked together.
    fn from_low(low: LowArgs) -> Result<GenArgs, String> {
        let model_dir = low.model_dir.ok_or("missing <MODEL_DIR>")?;
        // A state is the incremental session; full recompute gives the same ids.
        let stateful = low.save_state.is_some() || low.load_state.is_some();
        let mut prompts = low.prompts;
        let prompt = match prompts.len() {
            // After --load-state the saved tokens are the prompt; one given is appended.
            0 if low.load_state.is_some() => Prompt::Ids(Vec::new()),
            // Each line of --prompts is a prompt.
            0 if low.prompts_file.is_some() => Prompt::Ids(Vec::new()),
            _ if low.prompts_file.is_some() => {
                return Err("--prompts gives every prompt: give no other prompt flag".into())
            }
            0 => {
                return Err("no prompt: give exactly one of --prompt, --prompt-file, --ids".into())
            }
            1 => prompts.pop().expect("one prompt"),
            n => {
                return Err(format!(
                    "{n} prompts given: give exactly one of --prompt, --prompt-file, --ids"
                ))
            }
        };
        let needs_tok = !matches!(prompt, Prompt::Ids(_)) || low.chat;
        if needs_tok && low.tok.is_none() {
            return Err("--prompt, --prompt-file and --chat need --tok DIR (tiktoken.model + tokenizer_config.json); \
                 to skip the tokenizer pass --ids"
                .into());
        }
        if let Prompt::Ids(ids) = &prompt {
            if ids.len() > MAX_PROMPT {
                return Err(format!(
                    "prompt of {} ids exceeds the {MAX_PROMPT}-token limit",
                    ids.len()
                ));
            }
        }
        if low.chat_flags != ChatFlags::default() && !low.chat {
            return Err(
                "--no-thinking and --effort shape the chat prompt; they need --chat".into(),
            );
        }
        if !low.sampling.stop.is_empty() && low.tok.is_none() {
            return Err("--stop matches decoded text, which needs --tok DIR".into());
        }
        if low.prompts_file.is_some() {
            if low.tok.is_none() {
                return Err("--prompts holds text, which needs --tok DIR".into());
            }
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
        Ok(GenArgs {
            model_dir,
            prompt,
            chat: low.chat,
            chat_flags: low.chat_flags,
            tok: low.tok,
            mem: low.mem,
            trunk: low.trunk,
            gen: low.gen.unwrap_or(8),
            incremental: low.incremental || stateful,
            sampling: low.sampling,
            config: low.config,
            layers: low.layers,
            out: low.out.unwrap_or_else(|| PathBuf::from("k3_run.json")),
            dump_logits: low.dump_logits,
            dump_cache_trace: low.dump_cache_trace,
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

/// Parse `args` (without the program name) in two layers: `LowArgs` filled in order,
/// then `GenArgs::from_low`. Errors are usage errors (exit 2).
pub fn parse(args: &[String]) -> Result<Parsed, String> {
    let mut low = LowArgs::default();
    if let Some(special) = low.fill(args)? {
        return Ok(special);
    }
    Ok(Parsed::Run(Box::new(GenArgs::from_low(low)?)))
}

/// Every long flag the generation command knows (for "did you mean").
pub const FLAGS: &[&str] = &[
    "--prompt",
    "--prompt-file",
    "--ids",
    "--chat",
    "--no-thinking",
    "--effort",
    "--tok",
    "--preset",
    "--trunk",
    "--trunk-gb",
    "--cache-gb",
    "--gen",
    "--incremental",
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
    "--record",
    "--threads",
    "--numa",
    "--inproc",
    "--single-process",
    "--require-cgroups",
    "--stage-timeout",
    "--quiet",
    "--save-state",
    "--load-state",
    "--prompts",
    "--parallel",
    "--prefill-chunk",
    "--help",
    "--list-presets",
    "--n-predict",
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

    fn p(s: &str) -> Result<Parsed, String> {
        let v: Vec<String> = s.split_whitespace().map(str::to_string).collect();
        parse(&v)
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
        let a = run("m --preset server --cache-gb 40 --ids 1");
        assert_eq!(
            a.mem,
            vec![MemFlag::Preset("server".into()), MemFlag::CacheGb(40.0)]
        );
    }

    #[test]
    fn exactly_one_prompt() {
        assert!(p("m").unwrap_err().contains("no prompt"));
        assert!(p("m --ids 1 --ids 2").unwrap_err().contains("2 prompts"));
        assert!(p("m --prompt hi").unwrap_err().contains("--tok"));
        assert!(p("m --ids 1 --chat").unwrap_err().contains("--tok"));
        assert!(matches!(
            run("m --prompt hi --tok t").prompt,
            Prompt::Text(ref s) if s == "hi"
        ));
    }

    #[test]
    fn bad_values_are_usage_errors() {
        assert!(p("m --ids 1,x").is_err());
        assert!(p("m --ids 1,,2").is_err());
        assert!(p("m --ids 1 --gen 0").is_err());
        assert!(p("m --ids 1 --gen 4097").is_err());
        assert!(p("m --ids 1 --preset huge").is_err());
        assert!(p("m --ids 1 --trunk-gb -1").is_err());
        assert!(p("m --ids 1 --frobnicate").is_err());
        assert!(p("m n --ids 1").is_err());
        assert!(p("--ids 1").unwrap_err().contains("MODEL_DIR"));
        assert!(p("m --ids 1 --gen").unwrap_err().contains("needs a value"));
    }

    #[test]
    fn defaults_and_inline_values() {
        let a = run("m --ids=5,6 --gen=3");
        assert_eq!(a.prompt, Prompt::Ids(vec![5, 6]));
        assert_eq!(a.gen, 3);
        assert_eq!(a.out, PathBuf::from("k3_run.json"));
        assert!(!a.incremental);
    }

    #[test]
    fn help_and_presets_need_no_model() {
        assert!(matches!(p("--help"), Ok(Parsed::Help)));
        assert!(matches!(p("--list-presets"), Ok(Parsed::ListPresets)));
    }

    #[test]
    fn llama_cpp_spellings_are_aliases() {
        let a = run("m --ids 1 --temp 0.7 -n 5 -s 11 -t 2");
        assert_eq!(a.sampling.temperature, Some(0.7));
        assert_eq!(a.gen, 5);
        assert_eq!(a.sampling.seed, Some(11));
        assert_eq!(a.threads, Some(2));
        assert_eq!(run("m -p hi --tok t").prompt, Prompt::Text("hi".into()));
    }

    #[test]
    fn sampling_flags_and_resolution() {
        let a = run("m --ids 1 --top-k 5");
        // top-k alone samples (temperature 1), with a random seed when none is given.
        let c = a.sampling.resolve(|| 77);
        assert_eq!(c.temperature, Some(1.0));
        assert_eq!(c.top_k, Some(5));
        assert_eq!(c.seed, 77);
        assert!(!c.is_greedy());
        // Greedy by default: no random seed is drawn.
        let g = run("m --ids 1")
            .sampling
            .resolve(|| panic!("greedy draws no seed"));
        assert!(g.is_greedy());
        assert_eq!(g.seed, 0);
        // An explicit temperature 0 stays greedy; an explicit seed wins.
        let z = run("m --ids 1 --temp 0 --top-k 5 --seed 3")
            .sampling
            .resolve(|| 1);
        assert!(z.is_greedy());
        assert_eq!(z.seed, 3);
        let m = run("m --ids 1 --min-p 0.1 --repeat-penalty 1.3");
        let mc = m.sampling.resolve(|| 5);
        assert_eq!(mc.min_p, Some(0.1));
        assert_eq!(mc.repetition_penalty, Some(1.3));
        assert!(p("m --ids 1 --min-p 2").is_err());
        assert!(p("m --ids 1 --repeat-penalty 0").is_err());
        assert!(p("m --ids 1 --stop x").unwrap_err().contains("--tok"));
        let s = run("m --prompt hi --tok t --stop a --stop bc");
        assert_eq!(s.sampling.stop, vec!["a".to_string(), "bc".to_string()]);
    }

    #[test]
    fn chat_flags_match_tokenize() {
        let a = run("m --prompt hi --tok t --chat --no-thinking --effort low");
        assert!(!a.chat_flags.thinking);
        assert_eq!(a.chat_flags.effort.as_deref(), Some("low"));
        assert_eq!(
            run("m --prompt hi --tok t --chat --effort none")
                .chat_flags
                .effort,
            None
        );
        assert!(p("m --prompt hi --tok t --chat --effort medium").is_err());
        assert!(p("m --prompt hi --tok t --no-thinking")
            .unwrap_err()
            .contains("--chat"));
    }

    #[test]
    fn typos_get_a_suggestion() {
        assert!(p("m --ids 1 --temprature 1")
            .unwrap_err()
            .contains("did you mean --temperature"));
        assert_eq!(nearest("inpsect", &["inspect", "verify"]), Some("inspect"));
        assert_eq!(nearest("zzzzzz", &["inspect", "verify"]), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
