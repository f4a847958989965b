//! `k3-orch serve` (an OpenAI-compatible HTTP server) and `k3-orch chat` (a REPL), both on
//! one warm [`engine::Engine`]: the four stage processes are started once (the trunk is
//! loaded once) and every request reuses them, with prefix reuse across turns
//! (`--single-process`: the forward in this process). See docs/serve.md.
//!
//! - [`api`]: request validation (OpenAI bodies to tokenized jobs, error objects);
//! - [`engine`]: the worker thread, the prefix cache, the decode loop with streaming;
//! - [`http`]: the axum routes, SSE, `/health`, `/metrics`, the chat page;
//! - [`repl`]: `k3-orch chat`.

pub mod api;
pub mod engine;
pub mod http;
pub mod repl;

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

use crate::error::{EXIT_FAILED, EXIT_OK, EXIT_USAGE};
use engine::{Engine, EngineOptions};

/// Flags shared by `serve` and `chat`.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelFlags {
    /// Model directory (config.json + safetensors shards)
    pub model_dir: PathBuf,
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json)
    #[arg(long)]
    pub tok: PathBuf,
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
    /// Run the forward in this process instead of the four warm stage processes
    #[arg(long)]
    pub single_process: bool,
    /// The packed trunk (pack-trunk); without it the trunk-loader loads it whole
    #[arg(long)]
    pub trunk: Option<PathBuf>,
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
    pub fn engine(&self) -> Result<Engine, String> {
        if !self.model_dir.is_dir() {
            return Err(format!(
                "model directory {} does not exist",
                self.model_dir.display()
            ));
        }
        let threads = match self.threads {
            Some(0) => return Err("--threads must be at least 1".into()),
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        if self.ctx == 0 || self.max_tokens == 0 {
            return Err("--ctx and --max-tokens must be at least 1".into());
        }
        let warm = if self.single_process {
            None
        } else {
            Some(self.warm_launch(threads)?)
        };
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
            warm,
        })
    }

    /// The warm pipeline's configuration: the generation command line these flags stand
    /// for, through the same memory plan as a CLI run.
    fn warm_launch(&self, threads: usize) -> Result<crate::supervise::Launch, String> {
        let mut argv: Vec<String> = vec![
            self.model_dir.display().to_string(),
            "--ids".into(),
            "0".into(),
            "--incremental".into(),
            "--tok".into(),
            self.tok.display().to_string(),
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
        opt(
            "--config",
            self.config.as_ref().map(|p| p.display().to_string()),
        );
        opt("--layers", self.layers.map(|n| n.to_string()));
        opt(
            "--trunk",
            self.trunk.as_ref().map(|p| p.display().to_string()),
        );
        opt("--preset", self.preset.clone());
        opt("--mem-gb", self.mem_gb.map(|g| g.to_string()));
        if self.require_cgroups {
            argv.push("--require-cgroups".into());
        }
        let a = match crate::run::args::parse(&argv)? {
            crate::run::args::Parsed::Run(a) => a,
            _ => return Err("unexpected flags".into()),
        };
        crate::run::launch::warm_launch(&a).map_err(|e| e.to_string())
    }

    pub fn limits(&self) -> api::Limits {
        api::Limits {
            max_tokens: self.max_tokens,
            ctx: self.ctx,
            default_max_tokens: self.max_tokens.min(256),
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
    /// Requests queued or running at once; more get 429 with Retry-After
    #[arg(long, default_value_t = 16)]
    max_queue: usize,
}

/// Entry point of `k3-orch serve`.
pub fn serve_main(argv: Vec<OsString>) -> i32 {
    let a = match crate::tools::parse_args::<ServeArgs>(argv) {
        Ok(a) => a,
        Err(code) => return code,
    };
    if a.max_queue == 0 {
        tracing::error!("k3-orch serve: --max-queue must be at least 1");
        return EXIT_USAGE;
    }
    let engine = match a.model.engine() {
        Ok(e) => Arc::new(e),
        Err(e) => {
            tracing::error!("k3-orch serve: {e}");
            return EXIT_USAGE;
        }
    };
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
        limits: a.model.limits(),
        api_key: a.api_key.clone(),
        max_queue: a.max_queue,
        draining: draining.clone(),
        next_id: AtomicU64::new(1),
    });
    let stats = engine.stats.clone();
    let deadline_engine = engine.clone();
    let code = rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = match tokio::net::TcpListener::bind(&addr).await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("k3-orch serve: cannot listen on {addr}: {e}");
                return EXIT_FAILED;
            }
        };
        let local = listener
            .local_addr()
            .map_or(addr.clone(), |x| x.to_string());
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
        let r = axum::serve(listener, http::router(app))
            .with_graceful_shutdown(shutdown)
            .await;
        match r {
            Ok(()) => EXIT_OK,
            Err(e) => {
                tracing::error!("k3-orch serve: {e}");
                EXIT_FAILED
            }
        }
    });
    engine.stats.abort.store(true, Ordering::SeqCst);
    engine.shutdown();
    rt.shutdown_timeout(Duration::from_millis(200));
    code
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
