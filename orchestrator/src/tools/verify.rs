//! `k3-orch verify MODEL_DIR [--no-hashes | --hashes]`: is this checkpoint whole and consistent?
//!
//! Checks, naming every problem (not just the first): every shard the index names (and
//! every shard its `-of-N` numbering implies) is present; each shard's header is valid and
//! its size is exactly 8 + header + data end (a truncated shard says how many bytes are
//! missing); the index's `weight_map` and the shard headers name the same tensors in the
//! same shards; `metadata.total_size` equals the payload bytes of all shards.
//!
//! Sizes cannot see same-size corruption. When the model directory holds `SHA256SUMS`
//! (the format `sha256sum` writes and `sha256sum -c` reads: `<64 hex>  <file name>` per
//! line, `*` before the name allowed; `k3-orch synth --sums` writes one) every listed file
//! is hashed and compared; otherwise the report says plainly that hashes were not checked.
//! SHA256SUMS entries must be plain file names of regular files inside MODEL_DIR.
//!
//! The release: when the index is the release's (`metadata.total_size`) or released shard
//! names are present, every one of the 96 shards must have its published size
//! (`k3_model::released::SHARD_SIZES`), SHA256SUMS or not. `--hashes` hashes every shard
//! against the metadata `hf download --local-dir` leaves in `.cache/huggingface/download`
//! (the etag of an LFS file is its sha256). `config.json`, when present, must read.
//!
//! Exit 0 when everything checked is consistent, 1 when a problem was found, 2 on a usage
//! error or when MODEL_DIR is not a directory.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};

use clap::Parser;
use sha2::{Digest, Sha256};

use k3_model::catalog::Catalog;

/// Command line of `k3-orch verify`.
#[derive(Parser, Debug)]
#[command(
    name = "k3-orch verify",
    about = "Check a checkpoint's shards, headers, index, sizes (and SHA256SUMS when present)"
)]
struct Args {
    /// The checkpoint directory.
    model_dir: PathBuf,
    /// Skip hashing even when SHA256SUMS is present (sizes and headers only).
    #[arg(long, conflicts_with = "hashes")]
    no_hashes: bool,
    /// Hash every shard against the hub's download metadata (`hf download --local-dir`
    /// leaves `.cache/huggingface/download/<file>.metadata`, whose etag is the file's
    /// sha256), with a progress bar.
    #[arg(long)]
    hashes: bool,
}

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";
/// The hash list `verify` reads.
pub const SUMS_FILE: &str = "SHA256SUMS";

pub fn main(args: Vec<OsString>) -> i32 {
    let args = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    if !args.model_dir.is_dir() {
        tracing::error!(
            "k3-orch verify: {} is not a directory",
            args.model_dir.display()
        );
        return 2;
    }
    let mut r = verify_dir(&args.model_dir, !args.no_hashes);
    if args.hashes {
        check_hub_hashes(&args.model_dir, &mut r);
    }
    for l in &r.lines {
        println!("{l}");
    }
    for p in &r.problems {
        tracing::error!("  FAIL {p}");
    }
    if r.problems.is_empty() {
        println!("RESULT : OK");
        0
    } else {
        println!("RESULT : FAIL ({} problem(s))", r.problems.len());
        1
    }
}

/// What `verify` found: report lines and problems (empty when consistent).
#[derive(Debug, Default)]
pub struct VerifyReport {
    pub lines: Vec<String>,
    pub problems: Vec<String>,
}

/// The index, when there is one.
struct Index {
    total_size: Option<u64>,
    /// tensor -> shard file.
    weight_map: BTreeMap<String, String>,
}

/// Why the index cannot be used.
#[derive(Debug, thiserror::Error)]
enum IndexError {
    #[error("{INDEX}: cannot read: {0}")]
    Read(#[source] std::io::Error),
    #[error("{INDEX}: not valid JSON: {0}")]
    Json(#[source] serde_json::Error),
    #[error("{INDEX}: no weight_map object")]
    NoWeightMap,
    #[error("{INDEX}: weight_map[{0:?}] is not a file name")]
    NotAName(String),
    #[error(
        "{INDEX}: weight_map[{key:?}] is {file:?}, not a plain file name inside the model \
         directory"
    )]
    NotPlain { key: String, file: String },
}

fn read_index(path: &Path) -> Result<Index, IndexError> {
    let bytes = std::fs::read(path).map_err(IndexError::Read)?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(IndexError::Json)?;
    let total_size = v
        .get("metadata")
        .and_then(|m| m.get("total_size"))
        .and_then(|t| t.as_u64());
    let wm = v
        .get("weight_map")
        .and_then(|w| w.as_object())
        .ok_or(IndexError::NoWeightMap)?;
    let mut weight_map = BTreeMap::new();
    for (k, f) in wm {
        let f = f.as_str().ok_or_else(|| IndexError::NotAName(k.clone()))?;
        if !is_plain_name(f) {
            return Err(IndexError::NotPlain {
                key: k.clone(),
                file: f.to_string(),
            });
        }
        weight_map.insert(k.clone(), f.to_string());
    }
    Ok(Index {
        total_size,
        weight_map,
    })
}

/// `model-00003-of-000096.safetensors` -> (3, 96, digits of the total).
fn shard_number(name: &str) -> Option<(usize, usize, usize, usize)> {
    let rest = name.strip_prefix("model-")?.strip_suffix(".safetensors")?;
    let (a, b) = rest.split_once("-of-")?;
    if a.is_empty() || b.is_empty() || !a.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    if !b.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    Some((a.parse().ok()?, b.parse().ok()?, a.len(), b.len()))
}

/// Run every check on `dir` (hashing only when `hashes`).
pub fn verify_dir(dir: &Path, hashes: bool) -> VerifyReport {
    let mut r = VerifyReport::default();
    let index_path = dir.join(INDEX);
    let index = if index_path.is_file() {
        match read_index(&index_path) {
            Ok(i) => Some(i),
            Err(e) => {
                r.problems.push(e.to_string());
                return r;
            }
        }
    } else if dir.join(SINGLE).is_file() {
        None
    } else {
        r.problems.push(format!(
            "{}: neither {INDEX} nor {SINGLE} is present",
            dir.display()
        ));
        check_release(dir, None, &mut r);
        return r;
    };
    let shards = shard_list(dir, index.as_ref(), &mut r);
    let mut per_shard_index: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    if let Some(i) = &index {
        for (t, f) in &i.weight_map {
            per_shard_index
                .entry(f.as_str())
                .or_default()
                .insert(t.as_str());
        }
    }
    let mut sum = ShardSum::default();
    for s in &shards {
        let in_index = per_shard_index.get(s.as_str());
        check_shard(dir, s, index.as_ref(), in_index, &mut sum, &mut r);
    }
    sum_lines(dir, &shards, index.as_ref(), &sum, &mut r);
    check_release(dir, index.as_ref().and_then(|i| i.total_size), &mut r);
    check_config(dir, &mut r);
    check_sums(dir, hashes, &shards, &mut r);
    r
}

/// The shard list: what the index names (or the single file), plus what its -of-N
/// numbering implies and is on disk; a shard the numbering implies that the index does not
/// name is a problem.
fn shard_list(dir: &Path, index: Option<&Index>, r: &mut VerifyReport) -> BTreeSet<String> {
    let mut shards: BTreeSet<String> = match index {
        Some(i) => i.weight_map.values().cloned().collect(),
        None => [SINGLE.to_string()].into_iter().collect(),
    };
    let mut expected_by_numbering = BTreeSet::new();
    for s in &shards {
        if let Some((_, total, w1, w2)) = shard_number(s) {
            for k in 1..=total {
                expected_by_numbering.insert(format!(
                    "model-{k:0w1$}-of-{total:0w2$}.safetensors",
                    w1 = w1,
                    w2 = w2
                ));
            }
        }
    }
    for s in &expected_by_numbering {
        if !shards.contains(s) {
            if dir.join(s).is_file() {
                r.problems.push(format!(
                    "{s} is in the directory but the index maps no tensor to it"
                ));
            } else {
                r.problems.push(format!(
                    "missing shard: {s} (implied by the -of-N numbering; the index maps no \
                     tensor to it)"
                ));
            }
        }
    }
    shards.extend(
        expected_by_numbering
            .into_iter()
            .filter(|s| dir.join(s).is_file()),
    );
    shards
}

/// What the shards add up to.
#[derive(Default)]
struct ShardSum {
    present: usize,
    bytes_on_disk: u64,
    payload: u64,
    tensors: usize,
    /// A shard was missing or its header did not parse.
    some_failed: bool,
}

/// One shard: present, its header parses, its size adds up, and it holds what the index
/// says it holds (`in_index`: the tensors the index maps to it).
fn check_shard(
    dir: &Path,
    s: &str,
    index: Option<&Index>,
    in_index: Option<&BTreeSet<&str>>,
    sum: &mut ShardSum,
    r: &mut VerifyReport,
) {
    let path = dir.join(s);
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(_) => {
            r.problems.push(format!(
                "missing shard: {s} (the index maps {} tensors to it)",
                in_index.map_or(0, |x| x.len())
            ));
            sum.some_failed = true;
            return;
        }
    };
    if !meta.is_file() {
        // Never opened: a FIFO's open would wait for a writer forever.
        r.problems.push(format!(
            "{s}: not a regular file ({})",
            k3_io::input::kind_name(meta.file_type())
        ));
        sum.some_failed = true;
        return;
    }
    sum.present += 1;
    sum.bytes_on_disk += meta.len();
    let cat = match Catalog::from_files(std::slice::from_ref(&path)) {
        Ok(c) => c,
        Err(e) => {
            r.problems
                .push(diagnose(&path, s, meta.len(), &e.to_string()));
            sum.some_failed = true;
            return;
        }
    };
    let info = &cat.shards()[0];
    if info.file_size != info.data_end {
        r.problems.push(format!(
            "{s}: {} bytes but 8 + header {} + data {} = {} ({} extra bytes after the last \
             tensor)",
            info.file_size,
            info.header_len,
            info.data_end - info.data_start,
            info.data_end,
            info.file_size.saturating_sub(info.data_end)
        ));
    }
    sum.payload += cat.payload_bytes();
    sum.tensors += cat.len();
    if let Some(i) = index {
        check_names(s, &cat, i, in_index, r);
    }
}

/// A shard's header against the index: every tensor mapped here, every tensor mapped
/// here present.
fn check_names(
    s: &str,
    cat: &Catalog,
    i: &Index,
    in_index: Option<&BTreeSet<&str>>,
    r: &mut VerifyReport,
) {
    let mut not_in_index = Vec::new();
    let mut header_names = BTreeSet::new();
    for (name, _) in cat.iter() {
        match i.weight_map.get(&name) {
            Some(f) if f == s => {}
            Some(f) => r.problems.push(format!(
                "{s}: tensor {name} is here but the index maps it to {f}"
            )),
            None => not_in_index.push(name.clone()),
        }
        header_names.insert(name);
    }
    if !not_in_index.is_empty() {
        r.problems.push(format!(
            "{s}: {} tensor(s) missing from the index's weight_map: {}",
            not_in_index.len(),
            first_few(&not_in_index)
        ));
    }
    if let Some(want) = in_index {
        let absent: Vec<String> = want
            .iter()
            .filter(|n| !header_names.contains(**n))
            .map(|n| n.to_string())
            .collect();
        if !absent.is_empty() {
            r.problems.push(format!(
                "{s}: the index maps {} tensor(s) here that its header lacks: {}",
                absent.len(),
                first_few(&absent)
            ));
        }
    }
}

/// The shards, sizes and index lines; the index's total against the payload, and the
/// cross-shard checks when nothing else failed.
fn sum_lines(
    dir: &Path,
    shards: &BTreeSet<String>,
    index: Option<&Index>,
    sum: &ShardSum,
    r: &mut VerifyReport,
) {
    r.lines.push(format!(
        "shards : {} of {} present, {:.3} GB on disk",
        sum.present,
        shards.len(),
        sum.bytes_on_disk as f64 / 1e9
    ));
    if sum.some_failed {
        return;
    }
    let (tensors, payload) = (sum.tensors, sum.payload);
    r.lines.push(format!(
        "sizes  : headers valid; {tensors} tensors, {payload} payload bytes"
    ));
    let Some(i) = index else {
        r.lines
            .push(format!("index  : single file {SINGLE}, no index"));
        return;
    };
    match i.total_size {
        Some(t) if t == payload => r.lines.push(format!(
            "index  : weight_map covers {} tensors; total_size {t} matches",
            i.weight_map.len()
        )),
        Some(t) => r.problems.push(format!(
            "{INDEX}: metadata.total_size is {t} but the shards hold {payload} \
             payload bytes"
        )),
        None => r.problems.push(format!("{INDEX}: no metadata.total_size")),
    }
    // Cross-shard checks (duplicate names) on the whole set.
    if r.problems.is_empty() {
        if let Err(e) = Catalog::open(dir) {
            r.problems.push(e.to_string());
        }
    }
}

/// config.json reads (or is said to be unchecked when absent).
fn check_config(dir: &Path, r: &mut VerifyReport) {
    let cfg = dir.join("config.json");
    if cfg.exists() {
        match k3_model::config::ModelConfig::load(&cfg) {
            Ok(_) => r.lines.push("config : config.json reads".to_string()),
            Err(e) => r.problems.push(format!("config.json: {e}")),
        }
    } else {
        r.lines
            .push("config : NOT CHECKED: no config.json in the directory".to_string());
    }
}

fn first_few(v: &[String]) -> String {
    let mut s: Vec<&str> = v.iter().take(3).map(String::as_str).collect();
    if v.len() > 3 {
        s.push("...");
    }
    s.join(", ")
}

/// Say why a shard failed to parse, in sizes when it is a truncation.
fn diagnose(path: &Path, name: &str, size: u64, catalog_err: &str) -> String {
    let mut head = [0u8; 8];
    let ok = k3_io::input::open_regular(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok();
    if !ok {
        return format!("{name}: truncated: {size} bytes, not even the 8-byte header length");
    }
    let n = u64::from_le_bytes(head);
    if n.saturating_add(8) > size {
        return format!("{name}: truncated: {size} bytes, but the header alone is 8 + {n} bytes");
    }
    if n > k3_model::catalog::MAX_HEADER_BYTES {
        // Never read (or allocate) a header past the loader's limit: the catalog's own
        // error names it.
        return format!("{name}: {catalog_err}");
    }
    // Largest data end in the header, to name how much is missing.
    let end = (|| -> Option<u64> {
        let mut f = k3_io::input::open_regular(path).ok()?;
        let mut buf = vec![0u8; 8 + n as usize];
        f.read_exact(&mut buf).ok()?;
        let v: serde_json::Value = serde_json::from_slice(&buf[8..]).ok()?;
        v.as_object()?
            .iter()
            .filter(|(k, _)| *k != "__metadata__")
            .filter_map(|(_, e)| e.get("data_offsets")?.get(1)?.as_u64())
            .max()
    })();
    match end {
        Some(e) if 8 + n + e > size => format!(
            "{name}: truncated: {size} bytes, but 8 + header {n} + data end {e} = {} ({} bytes \
             missing)",
            8 + n + e,
            8 + n + e - size
        ),
        _ => format!("{name}: {catalog_err}"),
    }
}

/// Largest SHA256SUMS read (a line per file; the release has 96 shards).
const SUMS_CAP: u64 = 1 << 20;

/// A file name that stays inside the directory: no separator, not `.` or `..`.
fn is_plain_name(f: &str) -> bool {
    !f.is_empty() && f != "." && f != ".." && !f.contains('/') && !f.contains('\0')
}

/// sha256 of a file, with the progress bar advanced by its bytes.
fn sha256_file(path: &Path, bar: &indicatif::ProgressBar) -> std::io::Result<String> {
    let mut file = k3_io::input::open_regular(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        bar.inc(n as u64);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// `--hashes`: every shard against `.cache/huggingface/download/<shard>.metadata` (three
/// lines: commit hash, etag, timestamp; for LFS files the etag is the file's sha256).
fn check_hub_hashes(dir: &Path, r: &mut VerifyReport) {
    let meta_dir = dir.join(".cache/huggingface/download");
    let mut shards: Vec<String> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".safetensors"))
            .collect(),
        Err(e) => {
            r.problems.push(format!("{}: {e}", dir.display()));
            return;
        }
    };
    shards.sort();
    if !meta_dir.is_dir() {
        r.problems.push(format!(
            "--hashes: {} does not exist (the model was not fetched with `hf download \
             --local-dir`; scripts/download-model.sh does that), so there is nothing to check \
             the shards against",
            meta_dir.display()
        ));
        return;
    }
    let mut want = Vec::new();
    for s in &shards {
        let mp = meta_dir.join(format!("{s}.metadata"));
        let text = match super::read_capped(&mp, 4096) {
            Ok(t) => t,
            Err(e) => {
                r.problems.push(format!(
                    "{s}: no hub download metadata ({}: {e})",
                    mp.display()
                ));
                continue;
            }
        };
        let etag = text
            .lines()
            .nth(1)
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if etag.len() != 64 || !etag.bytes().all(|b| b.is_ascii_hexdigit()) {
            r.problems.push(format!(
                "{s}: the hub metadata's etag {etag:?} is not a sha256 (not an LFS file?)"
            ));
            continue;
        }
        want.push((s.clone(), etag));
    }
    let total: u64 = want
        .iter()
        .filter_map(|(s, _)| std::fs::metadata(dir.join(s)).ok())
        .map(|m| m.len())
        .sum();
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "verify --hashes {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut ok = 0usize;
    for (s, etag) in &want {
        match sha256_file(&dir.join(s), &bar) {
            Ok(got) if &got == etag => ok += 1,
            Ok(_) => r.problems.push(format!(
                "{s}: sha256 differs from the hub's etag (corrupted or changed; re-download it)"
            )),
            Err(e) => r
                .problems
                .push(format!("{s}: read error while hashing: {e}")),
        }
    }
    bar.finish_and_clear();
    r.lines.push(format!(
        "hub    : {ok} of {} shard(s) match the sha256 in the hub's download metadata",
        shards.len()
    ));
}

/// The release's shard sizes: when the index is the release's (its total_size) or the
/// directory holds released shard names, every released shard must have its published size.
fn check_release(dir: &Path, total_size: Option<u64>, r: &mut VerifyReport) {
    use k3_model::released::{shard_file_name, N_SHARDS, RELEASED_PAYLOAD, SHARD_SIZES};
    let names: Vec<String> = (1..=N_SHARDS).map(shard_file_name).collect();
    let any_named = names.iter().any(|n| dir.join(n).exists());
    if total_size != Some(RELEASED_PAYLOAD) && !any_named {
        return;
    }
    let mut same = 0usize;
    for (n, &want) in names.iter().zip(SHARD_SIZES.iter()) {
        match std::fs::metadata(dir.join(n)) {
            Ok(m) if m.len() == want => same += 1,
            Ok(m) => r.problems.push(format!(
                "{n}: {} bytes, the released shard is {want} ({})",
                m.len(),
                if m.len() < want {
                    format!("{} bytes short", want - m.len())
                } else {
                    format!("{} bytes too many", m.len() - want)
                }
            )),
            Err(_) => r
                .problems
                .push(format!("{n}: missing (the release has {N_SHARDS} shards)")),
        }
    }
    r.lines.push(format!(
        "release: {same} of {N_SHARDS} shards have the published size ({} bytes in all)",
        k3_model::released::RELEASED_BYTES
    ));
}

/// A line of `SHA256SUMS` (1-based) that is not `<hash>  <file>`.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{SUMS_FILE} line {0}: not '<hash>  <file>'")]
struct BadSumsLine(usize);

/// Parse `SHA256SUMS`: (hex, file) per line.
fn parse_sums(text: &str) -> Result<Vec<(String, String)>, BadSumsLine> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let (h, rest) = line.split_once(' ').ok_or(BadSumsLine(i + 1))?;
        let name = rest
            .strip_prefix(' ')
            .or_else(|| rest.strip_prefix('*'))
            .unwrap_or(rest);
        if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) || name.is_empty() {
            return Err(BadSumsLine(i + 1));
        }
        out.push((h.to_ascii_lowercase(), name.to_string()));
    }
    Ok(out)
}

fn check_sums(dir: &Path, hashes: bool, shards: &BTreeSet<String>, r: &mut VerifyReport) {
    let sums_path = dir.join(SUMS_FILE);
    if !sums_path.is_file() {
        r.lines.push(format!(
            "hashes : NOT CHECKED: no {SUMS_FILE} in {} (sizes cannot see same-size \
             corruption; add a sha256sum list to check it)",
            dir.display()
        ));
        return;
    }
    if !hashes {
        r.lines.push(format!(
            "hashes : NOT CHECKED (--no-hashes; {SUMS_FILE} is present)"
        ));
        return;
    }
    let text = match super::read_capped(&sums_path, SUMS_CAP) {
        Ok(t) => t,
        Err(e) => {
            r.problems.push(format!("{SUMS_FILE}: {e}"));
            return;
        }
    };
    let list = match parse_sums(&text) {
        Ok(l) => l,
        Err(e) => {
            r.problems.push(e.to_string());
            return;
        }
    };
    let total: u64 = list
        .iter()
        .filter(|(_, f)| is_plain_name(f))
        .filter_map(|(_, f)| std::fs::metadata(dir.join(f)).ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum();
    let bar = indicatif::ProgressBar::new(total);
    let mut ok = 0usize;
    let mut buf = vec![0u8; 8 << 20];
    for (want, f) in &list {
        if !is_plain_name(f) {
            r.problems.push(format!(
                "{SUMS_FILE} names {f:?}: only plain file names inside the model directory are \
                 checked"
            ));
            continue;
        }
        let path = dir.join(f);
        if !std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            r.problems.push(format!(
                "{f}: listed in {SUMS_FILE} but not a regular file in the model directory"
            ));
            continue;
        }
        let Ok(mut file) = k3_io::input::open_regular(&path) else {
            r.problems
                .push(format!("{f}: listed in {SUMS_FILE} but cannot be opened"));
            continue;
        };
        let mut h = Sha256::new();
        let res = loop {
            match file.read(&mut buf) {
                Ok(0) => break Ok(()),
                Ok(n) => {
                    h.update(&buf[..n]);
                    bar.inc(n as u64);
                }
                Err(e) => break Err(e),
            }
        };
        if let Err(e) = res {
            r.problems
                .push(format!("{f}: read error while hashing: {e}"));
            continue;
        }
        let got: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        if &got == want {
            ok += 1;
        } else {
            r.problems.push(format!(
                "{f}: sha256 mismatch (content differs from {SUMS_FILE}; re-download this file)"
            ));
        }
    }
    bar.finish_and_clear();
    let listed: BTreeSet<&str> = list.iter().map(|(_, f)| f.as_str()).collect();
    let unlisted: Vec<String> = shards
        .iter()
        .filter(|s| !listed.contains(s.as_str()))
        .cloned()
        .collect();
    r.lines.push(format!(
        "hashes : {ok} of {} files in {SUMS_FILE} match",
        list.len()
    ));
    if !unlisted.is_empty() {
        r.lines.push(format!(
            "hashes : {} shard(s) not listed in {SUMS_FILE}, not hashed: {}",
            unlisted.len(),
            first_few(&unlisted)
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_numbers() {
        assert_eq!(
            shard_number("model-00003-of-000096.safetensors"),
            Some((3, 96, 5, 6))
        );
        assert_eq!(shard_number("model.safetensors"), None);
        assert_eq!(shard_number("model-x-of-2.safetensors"), None);
    }

    #[test]
    fn sums_format() {
        let h = "a".repeat(64);
        let l = parse_sums(&format!("{h}  f1\n{h} *f2\n\n")).unwrap();
        assert_eq!(l, vec![(h.clone(), "f1".into()), (h, "f2".into())]);
        assert_eq!(parse_sums("ok\nzz  f"), Err(BadSumsLine(1)));
    }
}
