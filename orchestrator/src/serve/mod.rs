//! `k3-orch serve` (an OpenAI-compatible HTTP server) and `k3-orch chat` (a REPL), both on
//! one warm [`engine::Engine`]: the four stage processes are started once (the trunk is
//! loaded once) and every request reuses them, with prefix reuse across turns
//! (`--single-process`: the forward in this process). See docs/serve.md.
//!
//! - [`api`]: request validation (OpenAI bodies to tokenized jobs, error objects);
//! - [`conn`]: the accept loop: connection cap, header and keep-alive timeouts;
//! - [`engine`]: the worker thread: slots (continuous batching), the prefix cache,
//!   streaming;
//! - [`http`]: the axum routes, SSE, `/health`, `/metrics`, the chat page;
//! - [`metrics`]: Prometheus histograms;
//! - [`prompts`]: `k3-orch MODEL --prompts F.jsonl --parallel N`;
//! - [`repl`]: `k3-orch chat`.

pub mod api;
pub mod conn;
pub mod engine;
pub mod http;
pub mod metrics;
pub mod prompts;
pub mod repl;

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

use crate::error::{EXIT_FAILED, EXIT_OK, EXIT_USAGE};
use engine::{Engine, EngineOptions, SlotOptions};

/// A plan error as the message `serve` and `chat` log (exit 2).
fn plan_error(e: crate::run::error::GenError) -> String {
    e.to_string()
}

/// Flags shared by `serve` and `chat`.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelFlags {
    /// Model directory (config.json + safetensors shards)
    pub model_dir: PathBuf,
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json); without it the server
    /// takes token ids only (`/v1/completions` with a list of ids; ids in, ids out)
    #[arg(long)]
    pub tok: Option<PathBuf>,
    /// Model config (default MODEL_DIR/config.json)
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Compute threads (default: all cores)
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Bind only layers 0..N-1
    #[arg(long)]
    pub layers: Option<usize>,
    /// Prompt plus completion tokens one request may use (the KV budget)
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Largest max_tokens a request may ask for
    #[arg(long, default_value_t = 2048)]
    pub max_tokens: usize,
    /// Session states kept for prefix reuse (0 turns reuse off)
    #[arg(long, default_value_t = 8)]
    pub cache_entries: usize,
    /// Bytes of session states kept for prefix reuse, in GB (default: room for
    /// --cache-entries states of --ctx tokens)
    #[arg(long)]
    pub prefix_gb: Option<f64>,
    /// Prompt tokens per forward pass over the requests still prefilling, fed beside the
    /// others' decode steps (default: the largest that fits, at most 256)
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// Run the forward in this process instead of the four warm stage processes
    #[arg(long)]
    pub single_process: bool,
    /// The packed trunk (pack-trunk); without it the trunk-loader loads it whole
    #[arg(long)]
    pub trunk: Option<PathBuf>,
    /// With a coded --trunk: keep resident layers raw, coded or auto (as `k3-orch
    /// --trunk-resident`)
    #[arg(long, value_parser = ["raw", "coded", "auto"])]
    pub trunk_resident: Option<String>,
    /// With a coded --trunk that codes the lm_head: read a streamed lm_head raw, coded or
    /// auto (as `k3-orch --lm-head-read`)
    #[arg(long, value_parser = ["raw", "coded", "auto"])]
    pub lm_head_read: Option<String>,
    /// The packed routed experts (pack-experts), one directory per drive: DIR,DIR...
    #[arg(long, value_delimiter = ',')]
    pub experts: Vec<PathBuf>,
    /// Memory preset: laptop|desktop|workstation|server|max|auto
    #[arg(long)]
    pub preset: Option<String>,
    /// One total memory budget for the stages, in GB
    #[arg(long)]
    pub mem_gb: Option<f64>,
    /// Seconds a stage may stay silent before it is declared hung
    #[arg(long, default_value_t = 60.0)]
    pub stage_timeout: f64,
    /// Fail when per-stage memory cgroups cannot be created
    #[arg(long)]
    pub require_cgroups: bool,
}

impl ModelFlags {
    /// The engine over `slots` requests at once (at most `max_queue` more waiting), after
    /// the memory plan of those slots (refused up front, exit 2, when they do not fit).
    pub fn engine(&self, slots: usize, max_queue: usize) -> Result<Engine, String> {
        crate::run::check_model_dir(&self.model_dir).map_err(|e| e.to_string())?;
        let threads = match self.threads {
            Some(0) => return Err("--threads must be at least 1".into()),
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        if self.ctx == 0 || self.max_tokens == 0 || slots == 0 {
            return Err("--ctx, --max-tokens and --parallel must be at least 1".into());
        }
        let prefix_bytes = match self.prefix_gb {
            Some(g) if !(g.is_finite() && g >= 0.0) => {
                return Err(format!(
                    "--prefix-gb {g}: must be a non-negative number of GB"
                ))
            }
            Some(g) => Some((g * 1e9) as u64),
            None => None,
        };
        let shape = crate::run::plan::ServeShape {
            slots,
            ctx: self.ctx,
            chunk: self.prefill_chunk,
            prefix_entries: self.cache_entries,
            prefix_bytes,
        };
        let a = self.gen_args(threads)?;
        let (warm, plan) = if self.single_process {
            (
                None,
                crate::run::launch::serve_plan(&a, &shape).map_err(plan_error)?,
            )
        } else {
            let (l, p) =
                crate::run::launch::warm_launch(&a, &shape, max_queue).map_err(plan_error)?;
            (Some(l), p)
        };
        tracing::info!(
            "k3-orch serve: {slots} slot(s) of at most {} tokens, {max_queue} more may wait; \
             prompts fed {} tokens per pass; prefix cache {} entries, {}",
            self.ctx,
            plan.chunk,
            self.cache_entries,
            crate::units::human(plan.prefix_bytes)
        );
        Engine::start(EngineOptions {
            model_dir: self.model_dir.clone(),
            config_path: self
                .config
                .clone()
                .unwrap_or_else(|| self.model_dir.join("config.json")),
            tok_dir: self.tok.clone(),
            threads,
            layers: self.layers,
            cache_entries: self.cache_entries,
            slots: SlotOptions {
                slots,
                max_queue,
                prefill_chunk: plan.chunk,
                ctx: self.ctx,
                prefix_bytes: plan.prefix_bytes,
            },
            warm,
        })
        .map_err(|e| e.to_string())
    }

    /// The generation command line these flags stand for (what the memory plan and the
    /// warm pipeline's configuration are made from).
    fn gen_args(&self, threads: usize) -> Result<crate::run::args::GenArgs, String> {
        let mut argv: Vec<String> = vec![
            self.model_dir.display().to_string(),
            "--ids".into(),
            "0".into(),
            "--incremental".into(),
            "--threads".into(),
            threads.to_string(),
            "--stage-timeout".into(),
            self.stage_timeout.to_string(),
        ];
        let mut opt = |flag: &str, v: Option<String>| {
            if let Some(v) = v {
                argv.push(flag.into());
                argv.push(v);
            }
        };
        opt("--tok", self.tok.as_ref().map(|p| p.display().to_string()));
        opt(
            "--config",
            self.config.as_ref().map(|p| p.display().to_string()),
        );
        opt("--layers", self.layers.map(|n| n.to_string()));
        opt(
            "--trunk",
            self.trunk.as_ref().map(|p| p.display().to_string()),
        );
        opt("--trunk-resident", self.trunk_resident.clone());
        opt("--lm-head-read", self.lm_head_read.clone());
        if !self.experts.is_empty() {
            let dirs: Vec<String> = self
                .experts
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            opt("--experts", Some(dirs.join(",")));
        }
        opt("--preset", self.preset.clone());
        opt("--mem-gb", self.mem_gb.map(|g| g.to_string()));
        if self.require_cgroups {
            argv.push("--require-cgroups".into());
        }
        if self.single_process {
            argv.push("--single-process".into());
        }
        match crate::run::args::parse(&argv)? {
            crate::run::args::Parsed::Run(a) => Ok(*a),
            _ => Err("unexpected flags".into()),
        }
    }

    pub fn limits(&self) -> api::Limits {
        api::Limits {
            max_tokens: self.max_tokens,
            ctx: self.ctx,
            default_max_tokens: self.max_tokens.min(256),
            debug_logits: false,
        }
    }
}

/// Command line of `k3-orch serve`.
#[derive(Parser, Debug)]
#[command(
    name = "k3-orch serve",
    about = "OpenAI-compatible HTTP server (chat/completions, completions, models, health, \
             metrics, tokenize, detokenize, a chat page at /)"
)]
struct ServeArgs {
    #[command(flatten)]
    model: ModelFlags,
    /// Address to listen on
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the address is printed)
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize
    #[arg(long)]
    api_key: Option<String>,
    /// Requests decoding together (slots; 1 runs them one after another)
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Requests that may wait for a slot; more get 429 with Retry-After
    #[arg(long, default_value_t = 16)]
    max_queue: usize,
    /// Let requests ask for every step's logits (`"k3_logits": true`, as f32 bit patterns;
    /// a debug endpoint: the batch-invariance tests compare them bit for bit)
    #[arg(long)]
    debug_logits: bool,
    /// Connections held open at once (lowered to leave 64 of `ulimit -n`); at the cap a new
    /// one evicts the oldest idle connection, or gets 503 when every one runs a request
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// Seconds a connection has to send a complete request head, from its start or the
    /// end of its previous response (so also the keep-alive idle timeout)
    #[arg(long, default_value_t = 30.0)]
    header_timeout: f64,
    /// Seconds a request has to send its whole body once its head is in (then 408)
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// Largest request body in bytes (413, from Content-Length before the body is read)
    #[arg(long, default_value_t = 16 << 20)]
    max_body_bytes: usize,
    /// A host name browsers may reach this server by, besides localhost names and IP
    /// addresses (DNS-rebinding protection; repeatable)
    #[arg(long)]
    allow_host: Vec<String>,
}

impl ServeArgs {
    /// The connection limits, or why a flag is refused (exit 2).
    fn conn_limits(&self) -> Result<conn::ConnLimits, String> {
        let secs = |flag: &str, s: f64| {
            if s.is_finite() && s > 0.0 && s <= 86_400.0 {
                Ok(Duration::from_secs_f64(s))
            } else {
                Err(format!(
                    "{flag} {s}: must be a number of seconds above 0, at most 86400"
                ))
            }
        };
        if self.max_connections == 0 || self.max_body_bytes == 0 {
            return Err("--max-connections and --max-body-bytes must be at least 1".into());
        }
        let max_connections = conn::cap_for_fd_limit(self.max_connections);
        if max_connections < self.max_connections {
            tracing::warn!(
                "k3-orch serve: --max-connections {} lowered to {max_connections} to fit the \
                 file-descriptor limit (ulimit -n)",
                self.max_connections
            );
        }
        Ok(conn::ConnLimits {
            max_connections,
            header_timeout: secs("--header-timeout", self.header_timeout)?,
            body_timeout: secs("--body-timeout", self.body_timeout)?,
            max_body: self.max_body_bytes,
        })
    }

    /// The names browsers may reach this server by (beside localhost names): `--allow-host`,
    /// `--host` and the bound address (unless it is the unspecified address).
    fn hosts(&self, bound: Option<std::net::SocketAddr>) -> http::Hosts {
        let mut names: Vec<String> = self
            .allow_host
            .iter()
            .chain(std::iter::once(&self.host))
            .map(|n| n.trim_end_matches('.').to_ascii_lowercase())
            .collect();
        names.extend(bound.map(|a| a.ip().to_string()));
        names.retain(|n| {
            n.parse::<std::net::IpAddr>()
                .map_or(!n.is_empty(), |ip| !ip.is_unspecified())
        });
        http::Hosts { names }
    }
}

/// Entry point of `k3-orch serve`.
pub fn serve_main(argv: Vec<OsString>) -> i32 {
    let a = match crate::tools::parse_args::<ServeArgs>(argv) {
        Ok(a) => a,
        Err(code) => return code,
    };
    if a.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        tracing::error!("k3-orch serve: --api-key is empty: give a key, or no --api-key");
        return EXIT_USAGE;
    }
    let conn_limits = match a.conn_limits() {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("k3-orch serve: {e}");
            return EXIT_USAGE;
        }
    };
    // The port first: a busy port (or a host that does not resolve) is refused before
    // any stage starts or any weight is read.
    let std_listener = match bind(&a.host, a.port) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("k3-orch serve: {e}");
            return EXIT_USAGE;
        }
    };
    let engine = match a.model.engine(a.parallel, a.max_queue) {
        Ok(e) => Arc::new(e),
        Err(e) => {
            tracing::error!("k3-orch serve: {e}");
            return EXIT_USAGE;
        }
    };
    engine.stats.log_requests.store(true, Ordering::Relaxed);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("k3-orch serve: cannot start the runtime: {e}");
            return EXIT_FAILED;
        }
    };
    let draining = Arc::new(AtomicBool::new(false));
    let app = Arc::new(http::App {
        engine: engine.clone(),
        limits: api::Limits {
            debug_logits: a.debug_logits,
            ..a.model.limits()
        },
        api_key: a.api_key.clone(),
        conn: conn_limits,
        hosts: a.hosts(std_listener.local_addr().ok()),
        draining: draining.clone(),
        next_id: AtomicU64::new(1),
    });
    let stats = engine.stats.clone();
    let deadline_engine = engine.clone();
    let code = rt.block_on(async move {
        let listener = match tokio::net::TcpListener::from_std(std_listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("k3-orch serve: cannot listen: {e}");
                return EXIT_FAILED;
            }
        };
        let local = listener
            .local_addr()
            .map_or_else(|_| format!("{}:{}", a.host, a.port), |x| x.to_string());
        {
            use std::io::Write;
            let mut o = std::io::stdout().lock();
            let _ = writeln!(o, "k3-orch serve: listening on http://{local}");
            let _ = o.flush();
        }
        tracing::info!("k3-orch serve: loading {} ...", a.model.model_dir.display());
        let shutdown = async move {
            wait_for_signal().await;
            tracing::info!("k3-orch serve: shutting down (draining in-flight requests)");
            draining.store(true, Ordering::SeqCst);
            // In-flight work gets 2.5 s to finish, then is cut (between steps). At 3.5 s
            // whatever still runs (a stage that does not answer, a long prefill) has its
            // stages killed and cgroups removed from here, so the normal shutdown can end;
            // at 4.5 s the process exits regardless, after doing the same.
            let st = stats.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(2500));
                st.abort.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(1000));
                tracing::warn!("k3-orch serve: drain deadline passed; stopping the stages");
                deadline_engine.stop_stages_now();
                std::thread::sleep(Duration::from_millis(1000));
                tracing::warn!("k3-orch serve: still shutting down at 4.5 s; exiting");
                deadline_engine.stop_stages_now();
                std::process::exit(EXIT_OK);
            });
        };
        conn::serve(listener, http::router(app), conn_limits, shutdown).await;
        EXIT_OK
    });
    engine.stats.abort.store(true, Ordering::SeqCst);
    engine.shutdown();
    rt.shutdown_timeout(Duration::from_millis(200));
    code
}

/// The listening socket on `host:port` (non-blocking, for tokio), or why not (a port in
/// use, a host that does not resolve): `serve` binds it before it loads anything.
fn bind(host: &str, port: u16) -> Result<std::net::TcpListener, String> {
    let shown = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let l = std::net::TcpListener::bind((host, port)).map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
            " (another server is on that port: stop it, or choose another with --port; \
             --port 0 takes any free one)"
        } else {
            ""
        };
        format!("cannot listen on {shown}: {e}{hint}")
    })?;
    l.set_nonblocking(true)
        .map_err(|e| format!("cannot listen on {shown}: {e}"))?;
    Ok(l)
}

/// SIGTERM or SIGINT.
async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => {}
                _ = i.recv() => {}
            }
        }
        _ => std::future::pending::<()>().await,
    }
}
