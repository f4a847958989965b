//! The generation command line (`k3-orch <MODEL_DIR> [flags]`, docs/cli.md).
//!
//! Parsed by hand rather than with clap because the memory flags apply strictly left to
//! right (`--preset server --cache-gb 40` keeps the server trunk budget and overrides the
//! cache), which is the seed engine's contract and what its users' scripts rely on.

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

/// Sampling options; greedy when `temperature` is None or 0.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
}

/// Everything the generation command accepts.
#[derive(Clone, Debug, PartialEq)]
pub struct GenArgs {
    pub model_dir: PathBuf,
    pub prompt: Prompt,
    pub chat: bool,
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

prompt (exactly one):
  --prompt TEXT          tokenize TEXT (needs --tok)
  --prompt-file PATH     tokenize the file's bytes verbatim (needs --tok)
  --ids 1,2,3            token ids directly; no tokenizer is loaded
  --chat                 wrap the prompt as one user turn in K3's XTML chat format (needs --tok)
memory (applied left to right; a later flag wins):
  --preset NAME          laptop|desktop|workstation|server|max|auto (sets both budgets)
  --trunk DIR            the packed trunk (pack-trunk); without it the trunk is loaded whole
  --mem-gb X             one total budget for the whole run, spent to read the fewest bytes
                         per token (default: MemAvailable/cgroup room minus a 5% reserve)
  --trunk-gb X           budget for pinned trunk layers plus the streaming ring
  --cache-gb X           budget for the routed-expert cache
generation:
  --gen N                tokens to generate (default 8, at most 4096)
  --incremental          carry KV cache and recurrent state (same ids as full recompute)
  --tok DIR              tiktoken.model + tokenizer_config.json
  --temperature T --top-p P --top-k K --seed S
                         opt-in sampling; greedy by default
diagnostics:
  --config PATH          model config (default <MODEL_DIR>/config.json)
  --layers N             bind only layers 0..N-1
  --out FILE             JSON report (default k3_run.json)
  --dump-logits PATH     float32 LE logits of the first generation step
  --dump-cache-trace DIR expert_hist.json + expert_trace.bin
  --record DIR           record every stage's inbound messages and buffer hashes
  --threads N            compute threads (default: all cores)
  --numa SPEC            auto|off|stage=node,...
  --inproc               run the stages as threads in one process (same ids)
  --single-process       run the forward directly, without stages (same ids)
  --require-cgroups      fail when per-stage memory cgroups cannot be created
  --stage-timeout S      seconds a stage may stay silent before it is declared hung (default 60)
  --quiet                no per-step lines
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

/// Parse `args` (without the program name). Errors are usage errors (exit 2).
pub fn parse(args: &[String]) -> Result<Parsed, String> {
    let mut model_dir: Option<PathBuf> = None;
    let mut prompts: Vec<Prompt> = Vec::new();
    let mut a = GenArgs {
        model_dir: PathBuf::new(),
        prompt: Prompt::Ids(Vec::new()),
        chat: false,
        tok: None,
        mem: Vec::new(),
        trunk: None,
        gen: 8,
        incremental: false,
        sampling: Sampling::default(),
        config: None,
        layers: None,
        out: PathBuf::from("k3_run.json"),
        dump_logits: None,
        dump_cache_trace: None,
        record: None,
        threads: None,
        numa: None,
        inproc: false,
        single_process: false,
        require_cgroups: false,
        stage_timeout_s: 60.0,
        quiet: false,
    };
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        // Accept --flag=value as well as --flag value.
        let (flag, inline): (&str, Option<String>) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (arg, None),
        };
        let val = |i: &mut usize| -> Result<String, String> {
            match &inline {
                Some(v) => Ok(v.clone()),
                None => value(args, i, flag).map(str::to_string),
            }
        };
        match flag {
            "--help" | "-h" => return Ok(Parsed::Help),
            "--list-presets" => return Ok(Parsed::ListPresets),
            "--prompt" => prompts.push(Prompt::Text(val(&mut i)?)),
            "--prompt-file" => prompts.push(Prompt::File(PathBuf::from(val(&mut i)?))),
            "--ids" => prompts.push(Prompt::Ids(parse_ids(&val(&mut i)?)?)),
            "--chat" => a.chat = true,
            "--tok" => a.tok = Some(PathBuf::from(val(&mut i)?)),
            "--preset" => {
                let p = val(&mut i)?;
                match p.as_str() {
                    "laptop" | "desktop" | "workstation" | "server" | "max" | "auto" => {}
                    _ => {
                        return Err(format!(
                            "--preset: unknown preset '{p}' (laptop, desktop, workstation, server, max, auto)"
                        ))
                    }
                }
                a.mem.push(MemFlag::Preset(p));
            }
            "--trunk" => a.trunk = Some(PathBuf::from(val(&mut i)?)),
            "--trunk-gb" => a.mem.push(MemFlag::TrunkGb(gb(&val(&mut i)?, flag)?)),
            "--cache-gb" => a.mem.push(MemFlag::CacheGb(gb(&val(&mut i)?, flag)?)),
            "--mem-gb" => a.mem.push(MemFlag::MemGb(gb(&val(&mut i)?, flag)?)),
            "--gen" => {
                let n: usize = num(&val(&mut i)?, flag)?;
                if n == 0 || n > MAX_GEN {
                    return Err(format!("--gen: {n} is out of range (1..={MAX_GEN})"));
                }
                a.gen = n;
            }
            "--incremental" => a.incremental = true,
            "--temperature" => {
                let t: f32 = num(&val(&mut i)?, flag)?;
                if !t.is_finite() || t < 0.0 {
                    return Err(format!("--temperature: {t} must be >= 0"));
                }
                a.sampling.temperature = Some(t);
            }
            "--top-p" => {
                let p: f32 = num(&val(&mut i)?, flag)?;
                if !(p > 0.0 && p <= 1.0) {
                    return Err(format!("--top-p: {p} must be in (0, 1]"));
                }
                a.sampling.top_p = Some(p);
            }
            "--top-k" => {
                let k: usize = num(&val(&mut i)?, flag)?;
                if k == 0 {
                    return Err("--top-k: must be at least 1".into());
                }
                a.sampling.top_k = Some(k);
            }
            "--seed" => a.sampling.seed = Some(num(&val(&mut i)?, flag)?),
            "--config" => a.config = Some(PathBuf::from(val(&mut i)?)),
            "--layers" => {
                let n: usize = num(&val(&mut i)?, flag)?;
                if n == 0 {
                    return Err("--layers: must be at least 1".into());
                }
                a.layers = Some(n);
            }
            "--out" => a.out = PathBuf::from(val(&mut i)?),
            "--dump-logits" => a.dump_logits = Some(PathBuf::from(val(&mut i)?)),
            "--dump-cache-trace" => a.dump_cache_trace = Some(PathBuf::from(val(&mut i)?)),
            "--record" => a.record = Some(PathBuf::from(val(&mut i)?)),
            "--threads" => {
                let n: usize = num(&val(&mut i)?, flag)?;
                if n == 0 || n > 1024 {
                    return Err(format!("--threads: {n} is out of range (1..=1024)"));
                }
                a.threads = Some(n);
            }
            "--numa" => a.numa = Some(val(&mut i)?),
            "--inproc" => a.inproc = true,
            "--single-process" => a.single_process = true,
            "--require-cgroups" => a.require_cgroups = true,
            "--stage-timeout" => {
                let s: f64 = num(&val(&mut i)?, flag)?;
                if !(s > 0.0 && s.is_finite()) {
                    return Err("--stage-timeout: must be a positive number of seconds".into());
                }
                a.stage_timeout_s = s;
            }
            "--quiet" | "-q" => a.quiet = true,
            _ if flag.starts_with('-') => return Err(format!("unknown flag '{flag}'")),
            _ => {
                if model_dir.is_some() {
                    return Err(format!(
                        "unexpected argument '{arg}' (the model directory was already given)"
                    ));
                }
                model_dir = Some(PathBuf::from(arg));
            }
        }
        i += 1;
    }
    a.model_dir = model_dir.ok_or("missing <MODEL_DIR>")?;
    match prompts.len() {
        0 => return Err("no prompt: give exactly one of --prompt, --prompt-file, --ids".into()),
        1 => a.prompt = prompts.pop().expect("one prompt"),
        n => {
            return Err(format!(
                "{n} prompts given: give exactly one of --prompt, --prompt-file, --ids"
            ))
        }
    }
    let needs_tok = !matches!(a.prompt, Prompt::Ids(_)) || a.chat;
    if needs_tok && a.tok.is_none() {
        return Err("--prompt, --prompt-file and --chat need --tok DIR (tiktoken.model + tokenizer_config.json); \
             to skip the tokenizer pass --ids"
            .into());
    }
    if let Prompt::Ids(ids) = &a.prompt {
        if ids.len() > MAX_PROMPT {
            return Err(format!(
                "prompt of {} ids exceeds the {MAX_PROMPT}-token limit",
                ids.len()
            ));
        }
    }
    if a.inproc && a.single_process {
        return Err("--inproc and --single-process are different modes; give at most one".into());
    }
    Ok(Parsed::Run(Box::new(a)))
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
}
