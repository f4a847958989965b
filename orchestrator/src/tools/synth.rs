//! `k3-orch synth`: write a deterministic random model in the released multi-shard layout.
//!
//! `k3-orch synth --shape tiny|tiny-chat|slice|FILE.json [--seed N] [--layers N] [--experts N]
//! [--top-k N] [--vocab N] [--weights legacy|gaussian] [--sums] [--force] OUT_DIR`
//!
//! Layout (k3-spec §7): shards `model-%05d-of-%06d.safetensors`, layer l in shard l+1 with its
//! trunk first and contiguous (F32 then BF16 tensors, by name), then its routed experts in
//! lexicographic name order, each expert's tensors contiguous; a last shard with
//! embed_tokens, lm_head, model.norm and output_attn_res_{norm,proj}; the index
//! `model.safetensors.index.json`; a released-shape `config.json` (with a `k3_synth` key
//! saying how it was made). Experts are compressed-tensors MXFP4 (random codes, E8M0
//! scales chosen so a weight has rms ≈ 1/sqrt(in)) or BF16 `weight` tensors when a
//! dimension is not a multiple of 32. Projections are ~N(0, 1/sqrt(in)), norm gains ≈ 1.
//! With `--weights gaussian` (the default for `--shape slice`) the MXFP4 experts are real
//! quantizations of N(0, 1/sqrt(in)) groups instead (`synth/weights.rs`), and the run
//! prints the measured entropy of the BF16 exponents, E2M1 codes and E8M0 scales written.
//!
//! Values are a pure function of (seed, tensor name): each tensor has its own ChaCha8
//! stream seeded from sha256(seed, name). `--sums` also writes `SHA256SUMS`
//! (sha256sum format), which `k3-orch verify` checks.
//!
//! Everything is written into `OUT_DIR.tmp-<pid>` and renamed to OUT_DIR when complete and
//! fsynced; leftovers of dead runs (`OUT_DIR.tmp-<pid>` whose process is gone) are removed.

mod geometry;
pub mod tokenizer;
mod weights;

/// Shannon entropy of a histogram (what `synth` prints for what it writes).
pub use weights::bits;

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::OnceLock;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use clap::Parser;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

use k3_model::tensor::Dtype;

pub use geometry::{Geometry, GeometryError, Init, TensorSpec};
pub use weights::{Entropy, Weights};

/// Command line of `k3-orch synth`.
#[derive(Parser, Debug)]
#[command(
    name = "k3-orch synth",
    about = "Write a deterministic random K3 model in the released multi-shard layout"
)]
struct Args {
    /// `tiny` (13-layer fixture geometry), `tiny-chat` (tiny, 4 layers, released vocabulary, with tokenizer files: `k3-orch chat DIR --tok DIR`), `slice` (released per-layer dims, few layers and
    /// experts) or a config.json in the released shape.
    #[arg(long)]
    shape: String,
    /// Seed of every tensor's random stream.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Number of decoder layers (layer kinds follow the released rule: MLA iff (l+1)%4==0
    /// or the last layer; layer 0 dense).
    #[arg(long)]
    layers: Option<usize>,
    /// Routed experts per MoE layer.
    #[arg(long)]
    experts: Option<usize>,
    /// Experts selected per token.
    #[arg(long = "top-k")]
    top_k: Option<usize>,
    /// Vocabulary size (slice default 8192, reduced from the released 163840).
    #[arg(long)]
    vocab: Option<usize>,
    /// How values are drawn: `gaussian` (MXFP4 experts quantized from Gaussian groups; the
    /// default for `--shape slice`) or `legacy` (uniform random MXFP4 codes; the default
    /// for the other shapes, whose fixtures were made so).
    #[arg(long, value_enum)]
    weights: Option<Weights>,
    /// Also write SHA256SUMS (sha256sum format) over every file written.
    #[arg(long)]
    sums: bool,
    /// Replace OUT_DIR when it exists and is not empty.
    #[arg(long)]
    force: bool,
    /// With `--shape released`: write the 96 released shards as sparse header-only files
    /// (full size on paper, no data: about 120 MB of real disk) plus the index and the
    /// released config.json, for `inspect` and the planners at full scale. Nothing can run
    /// on them.
    #[arg(long = "headers-only")]
    headers_only: bool,
    /// Output directory (created).
    out_dir: PathBuf,
}

/// What a synth run wrote.
#[derive(Debug, Clone)]
pub struct SynthSummary {
    pub out_dir: PathBuf,
    pub shards: usize,
    pub tensors: usize,
    pub bytes: u64,
    pub seconds: f64,
    /// Histograms of the values written (BF16 exponents, MXFP4 codes and scales).
    pub entropy: Entropy,
}

/// Options of [`synth`] (the library form of the subcommand).
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub geometry: Geometry,
    pub shape_label: String,
    pub seed: u64,
    pub sums: bool,
    pub force: bool,
    pub progress: bool,
    /// Also write tiktoken.model + tokenizer_config.json with the released special ids
    /// (`--shape tiny-chat`).
    pub tokenizer: bool,
    /// How the values are drawn (`--weights`).
    pub weights: Weights,
}

pub fn main(args: Vec<OsString>) -> i32 {
    let args = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    if args.shape == "released" || args.headers_only {
        return released_headers(&args);
    }
    let geometry = match resolve_geometry(&args) {
        Ok(g) => g,
        Err(e) => {
            tracing::error!("k3-orch synth: {e}");
            return 2;
        }
    };
    let opts = SynthOptions {
        geometry,
        shape_label: args.shape.clone(),
        seed: args.seed,
        sums: args.sums,
        force: args.force,
        progress: true,
        tokenizer: args.shape == "tiny-chat",
        weights: args.weights.unwrap_or(if args.shape == "slice" {
            Weights::Gaussian
        } else {
            Weights::Legacy
        }),
    };
    match synth(&opts, &args.out_dir) {
        Ok(s) => {
            println!(
                "wrote {} shards, {} tensors ({} routed experts of {} bytes), {:.2} GB in \
                 {:.1} s ({:.0} MB/s) -> {}",
                s.shards,
                s.tensors,
                opts.geometry.experts
                    * opts
                        .geometry
                        .layers
                        .saturating_sub(opts.geometry.first_dense),
                opts.geometry.expert_bytes(),
                s.bytes as f64 / 1e9,
                s.seconds,
                s.bytes as f64 / 1e6 / s.seconds.max(1e-9),
                s.out_dir.display()
            );
            println!("{} ({} weights)", s.entropy.line(), opts.weights.name());
            0
        }
        Err(e) => {
            tracing::error!("k3-orch synth: {e:#}");
            match e.downcast_ref::<Refused>() {
                Some(_) => 2,
                None => 1,
            }
        }
    }
}

/// An up-front refusal (exit 2), as opposed to a failure while writing (exit 1).
#[derive(Debug)]
struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// `--shape`/`--vocab` that give no model this tool can write (exit 2).
#[derive(Debug, thiserror::Error)]
enum ShapeError {
    #[error("--shape {path}: not tiny, tiny-chat, slice or a readable config.json: {source}")]
    Unreadable {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    #[error("--vocab {0}: at least 256 (room for the special ids)")]
    Vocab(usize),
}

fn resolve_geometry(a: &Args) -> Result<Geometry, ShapeError> {
    let mut g = match a.shape.as_str() {
        "tiny" => Geometry::tiny(),
        "tiny-chat" => {
            // The tiny geometry at the released vocabulary (163,840, special ids from
            // 163,584) with 4 layers (3 KDA + 1 MLA): a chat model that answers in
            // milliseconds (gibberish, deterministic).
            let mut g = Geometry::tiny();
            g.vocab = 163_840;
            g.bos = 163_584;
            g.eos = 163_586;
            g.pad = 163_839;
            g.set_layers(4);
            g.note = "tiny-chat: the tiny geometry, 4 layers, the released vocabulary \
                      (163840) and special ids, with tokenizer files; random weights"
                .to_string();
            g
        }
        "slice" => Geometry::slice(a.vocab.unwrap_or(8192)),
        path => {
            let text = k3_io::input::read_capped_string(
                std::path::Path::new(path),
                k3_io::input::JSON_CAP,
            )
            .map_err(|source| ShapeError::Unreadable {
                path: path.to_string(),
                source,
            })?;
            Geometry::from_config_json(&text, path)?
        }
    };
    if let Some(v) = a.vocab {
        if v < 256 {
            return Err(ShapeError::Vocab(v));
        }
        g.vocab = v;
        g.bos = v - 256;
        g.eos = v - 254;
        g.pad = v - 1;
    }
    if let Some(l) = a.layers {
        g.set_layers(l);
    }
    if let Some(e) = a.experts {
        g.experts = e;
    }
    if let Some(k) = a.top_k {
        g.top_k = k;
    }
    if a.shape == "slice" {
        g.note = format!(
            "slice: released per-layer dimensions, {} layers, {} experts (top-{}); vocab \
             reduced from 163840 to {} (special ids bos {} eos {} pad {}); random weights",
            g.layers, g.experts, g.top_k, g.vocab, g.bos, g.eos, g.pad
        );
    }
    g.check()?;
    Ok(g)
}

/// Write the model described by `opts` into `out_dir` (atomically, see the module doc).
pub fn synth(opts: &SynthOptions, out_dir: &Path) -> Result<SynthSummary> {
    let g = &opts.geometry;
    g.check().map_err(|e| Refused(e.to_string()))?;
    if out_dir.is_file() {
        return Err(Refused(format!("{} exists and is a file", out_dir.display())).into());
    }
    if out_dir.is_dir() {
        let non_empty = fs::read_dir(out_dir)
            .with_context(|| format!("reading {}", out_dir.display()))?
            .next()
            .is_some();
        if non_empty && !opts.force {
            return Err(Refused(format!(
                "{} exists and is not empty (pass --force to replace it)",
                out_dir.display()
            ))
            .into());
        }
    }
    let out_name = out_dir
        .file_name()
        .ok_or_else(|| Refused(format!("{}: no directory name", out_dir.display())))?
        .to_string_lossy()
        .into_owned();
    let parent = match out_dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&parent).with_context(|| format!("creating {}", parent.display()))?;
    remove_stale_tmp(&parent, &out_name);
    // Size first: a multi-TB geometry is refused before a byte is written, with the numbers.
    let payload: u64 = geometry::shards(g)
        .iter()
        .flat_map(|s| s.tensors.iter())
        .map(TensorSpec::bytes)
        .sum();
    if let Ok(st) = rustix::fs::statvfs(&parent) {
        let free = st.f_bavail.saturating_mul(st.f_frsize);
        // Headers, the index and the file system's own blocks: 1% and 64 MiB of room.
        let need = payload + payload / 100 + (64 << 20);
        tracing::info!(
            "synth: {:.2} GB of tensors to write, {:.2} GB free in {}",
            payload as f64 / 1e9,
            free as f64 / 1e9,
            parent.display()
        );
        if need > free {
            return Err(Refused(format!(
                "this geometry writes {:.2} GB ({payload} bytes of tensors) and {} has {:.2} GB \
                 free: free space or choose fewer --layers/--experts",
                need as f64 / 1e9,
                parent.display(),
                free as f64 / 1e9
            ))
            .into());
        }
    }
    let tmp = parent.join(format!("{out_name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
    }
    fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;

    let result = write_model(opts, &tmp).and_then(|s| {
        if opts.tokenizer {
            let (model, config) = tokenizer::files()?;
            fs::write(tmp.join("tiktoken.model"), model)?;
            fs::write(tmp.join("tokenizer_config.json"), config)?;
        }
        Ok(s)
    });
    let summary = match result {
        Ok(s) => s,
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if out_dir.exists() {
        fs::remove_dir_all(out_dir)
            .with_context(|| format!("removing the old {}", out_dir.display()))?;
    }
    fs::rename(&tmp, out_dir)
        .with_context(|| format!("renaming {} to {}", tmp.display(), out_dir.display()))?;
    if let Ok(d) = File::open(&parent) {
        let _ = d.sync_all();
    }
    Ok(SynthSummary {
        out_dir: out_dir.to_path_buf(),
        ..summary
    })
}

/// Remove `<name>.tmp-<pid>` siblings whose process no longer runs (an interrupted synth).
fn remove_stale_tmp(parent: &Path, name: &str) {
    let prefix = format!("{name}.tmp-");
    let Ok(rd) = fs::read_dir(parent) else { return };
    for ent in rd.flatten() {
        let fname = ent.file_name().to_string_lossy().into_owned();
        let Some(pid) = fname.strip_prefix(&prefix) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::warn!(
                "synth: removing {} left by an interrupted run",
                ent.path().display()
            );
            let _ = fs::remove_dir_all(ent.path());
        }
    }
}

/// Writer-thread messages.
enum Msg {
    Open(PathBuf),
    Data(Vec<u8>),
    Close,
}

/// Bytes per generated chunk.
const CHUNK: usize = 16 << 20;

fn write_model(opts: &SynthOptions, dir: &Path) -> Result<SynthSummary> {
    let g = &opts.geometry;
    let start = Instant::now();
    let shards = geometry::shards(g);
    let payload: u64 = shards
        .iter()
        .flat_map(|s| s.tensors.iter())
        .map(TensorSpec::bytes)
        .sum();
    let bar = progress_bar(opts.progress, payload);
    let (tx, rx) = sync_channel::<Msg>(4);
    let (ret_tx, ret_rx) = sync_channel::<Vec<u8>>(8);
    let want_sums = opts.sums;
    let writer = std::thread::spawn(move || writer_thread(rx, ret_tx, want_sums));
    let mut entropy = Entropy::default();
    let gen = generate(opts, dir, &shards, (&tx, &ret_rx), &bar, &mut entropy);
    drop(tx);
    let written = writer
        .join()
        .map_err(|_| anyhow!("the writer thread panicked"))?;
    bar.finish_and_clear();
    let mut sums = match (gen, written) {
        (_, Err(e)) => return Err(e),
        (Err(e), _) => return Err(e),
        (Ok(()), Ok(s)) => s,
    };
    write_index_and_config(opts, dir, &shards, payload, &mut sums)?;
    if opts.sums {
        sums.sort();
        let text: String = sums.iter().map(|(f, h)| format!("{h}  {f}\n")).collect();
        write_synced(&dir.join("SHA256SUMS"), text.as_bytes())?;
    }
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(SynthSummary {
        out_dir: dir.to_path_buf(),
        shards: shards.len(),
        tensors: shards.iter().map(|s| s.tensors.len()).sum(),
        bytes: payload,
        seconds: start.elapsed().as_secs_f64(),
        entropy,
    })
}

/// A progress bar over `payload` bytes (hidden without `--progress`).
fn progress_bar(shown: bool, payload: u64) -> indicatif::ProgressBar {
    if !shown {
        return indicatif::ProgressBar::hidden();
    }
    let b = indicatif::ProgressBar::new(payload);
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "synth {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    b
}

/// Generate every shard's header and tensor bytes, in chunks of at most [`CHUNK`], and hand
/// them to the writer thread (`tx`; emptied buffers come back on `ret_rx`).
fn generate(
    opts: &SynthOptions,
    dir: &Path,
    shards: &[geometry::ShardSpec],
    (tx, ret_rx): (&SyncSender<Msg>, &Receiver<Vec<u8>>),
    bar: &indicatif::ProgressBar,
    entropy: &mut Entropy,
) -> Result<()> {
    for shard in shards {
        bar.set_message(shard.file.clone());
        let header = safetensors_header(&shard.tensors);
        let path = dir.join(&shard.file);
        send(tx, Msg::Open(path))?;
        send(tx, Msg::Data(header))?;
        let mut buf = take_buf(ret_rx);
        for t in &shard.tensors {
            let (init, stream) = weights::effective(t, opts.weights);
            let mut rng = tensor_rng(opts.seed, &stream);
            let n = t.shape.iter().product::<usize>();
            let esz = t.dtype.size();
            let per_chunk = (CHUNK / esz / 1024).max(1) * 1024;
            let mut done = 0usize;
            while done < n {
                let k = per_chunk.min(n - done);
                if buf.len() + k * esz > CHUNK && !buf.is_empty() {
                    send(tx, Msg::Data(std::mem::take(&mut buf)))?;
                    buf = take_buf(ret_rx);
                }
                let at = buf.len();
                buf.resize(at + k * esz, 0);
                fill(t, init, &mut rng, done, &mut buf[at..]);
                entropy.count(t, init, &buf[at..]);
                done += k;
                bar.inc((k * esz) as u64);
            }
        }
        if !buf.is_empty() {
            send(tx, Msg::Data(buf))?;
        }
        send(tx, Msg::Close)?;
    }
    Ok(())
}

/// The safetensors index (weight_map sorted by name, the payload's total_size) and
/// config.json, written and (with `--sums`) hashed into `sums`.
fn write_index_and_config(
    opts: &SynthOptions,
    dir: &Path,
    shards: &[geometry::ShardSpec],
    payload: u64,
    sums: &mut Vec<(String, String)>,
) -> Result<()> {
    let mut weight_map = serde_json::Map::new();
    let mut names: Vec<(&str, &str)> = shards
        .iter()
        .flat_map(|s| {
            s.tensors
                .iter()
                .map(move |t| (t.name.as_str(), s.file.as_str()))
        })
        .collect();
    names.sort();
    for (n, f) in names {
        weight_map.insert(n.to_string(), serde_json::Value::String(f.to_string()));
    }
    let index = serde_json::json!({
        "metadata": { "total_size": payload },
        "weight_map": weight_map,
    });
    let small = [
        (
            "model.safetensors.index.json",
            serde_json::to_vec_pretty(&index)?,
        ),
        (
            "config.json",
            serde_json::to_vec_pretty(&config_json(opts))?,
        ),
    ];
    for (name, bytes) in &small {
        write_synced(&dir.join(name), bytes)?;
        if opts.sums {
            sums.push((name.to_string(), hex(&Sha256::digest(bytes))));
        }
    }
    Ok(())
}

fn send(tx: &SyncSender<Msg>, m: Msg) -> Result<()> {
    // A send fails only when the writer stopped; its own error is reported by join.
    tx.send(m)
        .map_err(|_| anyhow!("the writer stopped early (see its error)"))
}

fn take_buf(ret: &Receiver<Vec<u8>>) -> Vec<u8> {
    match ret.try_recv() {
        Ok(mut b) => {
            b.clear();
            b
        }
        Err(_) => Vec::with_capacity(CHUNK),
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("writing {}", path.display()))?;
    f.sync_all()
        .with_context(|| format!("fsync {}", path.display()))?;
    Ok(())
}

/// Writes what it receives; returns (file name, sha256) per file when `sums`.
fn writer_thread(
    rx: Receiver<Msg>,
    ret: SyncSender<Vec<u8>>,
    sums: bool,
) -> Result<Vec<(String, String)>> {
    let mut cur: Option<(File, PathBuf, Sha256, u64, super::pack_trunk::WriteFlow)> = None;
    let mut out = Vec::new();
    for m in rx {
        match m {
            Msg::Open(p) => {
                let f = File::create(&p).with_context(|| format!("creating {}", p.display()))?;
                cur = Some((f, p, Sha256::new(), 0, Default::default()));
            }
            Msg::Data(b) => {
                let (f, p, h, at, flow) = cur
                    .as_mut()
                    .ok_or_else(|| anyhow!("internal: data before a file was opened"))?;
                f.write_all(&b)
                    .with_context(|| format!("writing {}", p.display()))?;
                // Start writeback now and bound the dirty pages (see pack_trunk::WriteFlow).
                flow.wrote(f, *at, b.len() as u64);
                *at += b.len() as u64;
                if sums {
                    h.update(&b);
                }
                let _ = ret.try_send(b);
            }
            Msg::Close => {
                if let Some((f, p, h, _, _)) = cur.take() {
                    f.sync_all()
                        .with_context(|| format!("fsync {}", p.display()))?;
                    if sums {
                        let name = p
                            .file_name()
                            .map(|n| n.to_string_lossy().into_owned())
                            .unwrap_or_default();
                        out.push((name, hex(&h.finalize())));
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Lower-case hex.
fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The safetensors header of one shard: u64 LE length, then JSON (`__metadata__` first,
/// then every tensor in data order) padded with spaces to a multiple of 8.
pub fn safetensors_header(tensors: &[TensorSpec]) -> Vec<u8> {
    let mut json = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut off = 0u64;
    for t in tensors {
        let end = off + t.bytes();
        let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            ",\"{}\":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            t.name,
            t.dtype.as_str(),
            shape.join(","),
            off,
            end
        ));
        off = end;
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out
}

/// config.json: the geometry's, with `k3_synth.weights` when not `legacy` (so a legacy
/// model's config is what it always was).
fn config_json(opts: &SynthOptions) -> serde_json::Value {
    let mut v = opts.geometry.config_json(&opts.shape_label, opts.seed);
    if opts.weights != Weights::Legacy {
        if let Some(k) = v.get_mut("k3_synth").and_then(|k| k.as_object_mut()) {
            k.insert("weights".into(), opts.weights.name().into());
        }
    }
    v
}

/// The random stream of one tensor: ChaCha8 seeded with sha256(seed LE, name).
fn tensor_rng(seed: u64, name: &str) -> ChaCha8Rng {
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(name.as_bytes());
    ChaCha8Rng::from_seed(h.finalize().into())
}

/// 65,536 standard-normal samples (Box-Muller from a fixed stream), indexed by a random
/// u16: a fast, deterministic ~N(0, 1) draw.
fn normal_table() -> &'static [f32] {
    static T: OnceLock<Vec<f32>> = OnceLock::new();
    T.get_or_init(|| {
        let mut rng = ChaCha8Rng::seed_from_u64(0x6b33_6e6f_726d);
        let mut v = Vec::with_capacity(65536);
        while v.len() < 65536 {
            let u1: f64 = rng.gen::<f64>().max(1e-300);
            let u2: f64 = rng.gen::<f64>();
            let r = (-2.0 * u1.ln()).sqrt();
            let a = 2.0 * std::f64::consts::PI * u2;
            v.push((r * a.cos()) as f32);
            v.push((r * a.sin()) as f32);
        }
        v
    })
}

/// One routed expert matrix of `rows` x `fan_in` as `synth --weights gaussian --seed SEED`
/// writes the matrix called `name` (`*.weight`): its MXFP4 codes and its E8M0 scales, the
/// real quantization of N(0, 1/sqrt(fan_in)) groups (what `benches/codec_experts.rs`
/// measures the codec on). `fan_in` is a multiple of 32.
pub fn gaussian_expert_planes(
    seed: u64,
    name: &str,
    rows: usize,
    fan_in: usize,
) -> (Vec<u8>, Vec<u8>) {
    let rng = tensor_rng(seed, name);
    let std = 1.0 / (fan_in.max(1) as f32).sqrt();
    let mut codes = vec![0u8; rows * fan_in / 2];
    let mut scales = vec![0u8; rows * fan_in / 32];
    weights::fill_quantized(&rng, normal_table(), std, true, 0, &mut codes);
    weights::fill_quantized(&rng, normal_table(), std, false, 0, &mut scales);
    (codes, scales)
}

/// `n` BF16 values as `synth --weights gaussian --seed SEED` writes a BF16 tensor called
/// `name` of fan-in `fan_in`: N(0, 1/sqrt(fan_in)), rounded to nearest (what `project`
/// times the trunk codec's decoder on).
pub fn gaussian_bf16(seed: u64, name: &str, n: usize, fan_in: usize) -> Vec<u8> {
    let t = TensorSpec {
        name: name.to_string(),
        dtype: Dtype::BF16,
        shape: vec![n],
        init: Init::Normal(1.0 / (fan_in.max(1) as f32).sqrt()),
    };
    let mut out = vec![0u8; 2 * n];
    fill(&t, t.init, &mut tensor_rng(seed, name), 0, &mut out);
    out
}

/// Fill `out` with elements `first..first + out.len()/size` of tensor `t`.
/// `init` is what the tensor holds (`t.init`, or its `--weights` form).
fn fill(t: &TensorSpec, init: Init, rng: &mut ChaCha8Rng, first: usize, out: &mut [u8]) {
    match init {
        Init::Packed => rng.fill_bytes(out),
        Init::QuantCodes(std) => {
            weights::fill_quantized(rng, normal_table(), std, true, first, out)
        }
        Init::QuantScales(std) => {
            weights::fill_quantized(rng, normal_table(), std, false, first, out)
        }
        Init::Scale(c) => {
            rng.fill_bytes(out);
            let lo = c.saturating_sub(1);
            for b in out.iter_mut() {
                *b = lo + *b % 3;
            }
        }
        init => {
            let esz = t.dtype.size();
            let n = out.len() / esz;
            let mut r = vec![0u8; 2 * n];
            rng.fill_bytes(&mut r);
            let table = normal_table();
            let value = |i: usize, u: u16| -> f32 {
                match init {
                    Init::Normal(std) => table[u as usize] * std,
                    Init::Gain => 1.0 + 0.02 * table[u as usize],
                    Init::Uniform(lo, hi) => lo + (u as f32 / 65536.0) * (hi - lo),
                    Init::ALog(heads) => {
                        if first + i < heads {
                            (0.5 + 7.5 * (u as f32 / 65536.0)).ln()
                        } else {
                            0.0
                        }
                    }
                    Init::Packed | Init::Scale(_) | Init::QuantCodes(_) | Init::QuantScales(_) => {
                        0.0
                    }
                }
            };
            match t.dtype {
                Dtype::F32 => {
                    for (i, (o, u)) in out.chunks_exact_mut(4).zip(r.chunks_exact(2)).enumerate() {
                        let v = value(i, u16::from_le_bytes([u[0], u[1]]));
                        o.copy_from_slice(&v.to_le_bytes());
                    }
                }
                _ => {
                    // BF16 (every other floating tensor this tool writes).
                    for (i, (o, u)) in out.chunks_exact_mut(2).zip(r.chunks_exact(2)).enumerate() {
                        let v = value(i, u16::from_le_bytes([u[0], u[1]]));
                        o.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
                    }
                }
            }
        }
    }
}

/// The released config.json (the fixture transcribed from k3-spec.md section 1).
pub const RELEASED_CONFIG: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/released/config.json"
));

/// `synth --shape released --headers-only OUT_DIR`.
fn released_headers(a: &Args) -> i32 {
    if a.shape != "released" || !a.headers_only {
        tracing::error!(
            "k3-orch synth: --headers-only goes with --shape released, and --shape released \
             only with --headers-only (its weights are 1.45 TB)"
        );
        return 2;
    }
    let nonempty = fs::read_dir(&a.out_dir).is_ok_and(|mut d| d.next().is_some());
    if nonempty && !a.force {
        tracing::error!(
            "k3-orch synth: {} exists and is not empty (--force replaces it)",
            a.out_dir.display()
        );
        return 2;
    }
    let t0 = std::time::Instant::now();
    let set = match k3_model::released::write_header_only_set(&a.out_dir)
        .and_then(|s| fs::write(a.out_dir.join("config.json"), RELEASED_CONFIG).map(|_| s))
    {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("k3-orch synth: {}: {e}", a.out_dir.display());
            return 1;
        }
    };
    println!(
        "wrote {} header-only shards, {} tensors, {:.2} TB on paper ({} bytes of headers) in {:.1} s -> {}",
        k3_model::released::N_SHARDS,
        set.n_tensors,
        set.payload_bytes as f64 / 1e12,
        set.header_bytes,
        t0.elapsed().as_secs_f64(),
        a.out_dir.display()
    );
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Header layout: 8-byte LE length, JSON padded to a multiple of 8, offsets back to
    /// back. A writer that forgot the padding or started offsets at the header would fail.
    #[test]
    fn header_is_padded_and_offsets_chain() {
        let ts = vec![
            TensorSpec {
                name: "a".into(),
                dtype: Dtype::F32,
                shape: vec![3],
                init: Init::Gain,
            },
            TensorSpec {
                name: "b".into(),
                dtype: Dtype::BF16,
                shape: vec![2, 2],
                init: Init::Gain,
            },
        ];
        let h = safetensors_header(&ts);
        let n = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(n + 8, h.len());
        assert_eq!(n % 8, 0);
        let v: serde_json::Value = serde_json::from_slice(&h[8..]).unwrap();
        assert_eq!(v["a"]["data_offsets"], serde_json::json!([0, 12]));
        assert_eq!(v["b"]["data_offsets"], serde_json::json!([12, 20]));
    }

    /// Same seed and name, same bytes, whatever the chunking; another seed differs.
    #[test]
    fn fill_is_deterministic() {
        let t = TensorSpec {
            name: "x".into(),
            dtype: Dtype::BF16,
            shape: vec![4096],
            init: Init::Normal(0.1),
        };
        let mut a = vec![0u8; 8192];
        fill(&t, t.init, &mut tensor_rng(1, "x"), 0, &mut a);
        let mut b = vec![0u8; 8192];
        let mut r = tensor_rng(1, "x");
        fill(&t, t.init, &mut r, 0, &mut b[..4096]);
        fill(&t, t.init, &mut r, 2048, &mut b[4096..]);
        assert_eq!(a, b);
        let mut c = vec![0u8; 8192];
        fill(&t, t.init, &mut tensor_rng(2, "x"), 0, &mut c);
        assert_ne!(a, c);
    }
}
