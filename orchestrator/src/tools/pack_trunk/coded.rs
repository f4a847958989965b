//! `pack-trunk --codec NAME`: the coding phase. After the raw pack (`trunk.bin` +
//! `trunk.json`, resumable as ever), every layer's run is read back, checked against its
//! CRCs, encoded in chunks of `CODEC_CHUNK` decoded bytes (on every core) and appended to
//! `trunk.k3z.partial`; `trunk.k3z.partial.json` (the journal: the digest of the raw
//! manifest and codec, and the layers done) is replaced after each layer is fsynced, so a
//! re-run resumes after the last journaled layer. When every layer is in, the data is
//! renamed to `trunk.k3z`, the coded manifest replaces `trunk.json` atomically (the commit:
//! until then the raw trunk is the complete one) and only then is `trunk.bin` removed.
//!
//! `--verify` of a coded trunk reads every chunk, checks its stored CRC, decodes it, checks
//! the decoded CRC, the layer's sha256 and per-MiB CRCs and the zero padding; a damaged
//! chunk is named by layer and chunk.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use k3_model::catalog::Catalog;
use k3_model::classify::LM_HEAD;
use k3_model::codec::{Codec, Decoder, Effort};
use k3_model::codec_trunk::{
    check_stored, decode_chunk, encode_head_rows, encode_run, head_chunk_rows, Unit,
};
use k3_model::tensor::Dtype;
use k3_model::trunk::{
    CodedChunk, CodedHead, CodedLayer, TrunkCodec, TrunkManifest, CODEC_CHUNK, CODED_BIN,
    CODED_HEAD_BIN, TRUNK_BIN, TRUNK_CODED_FORMAT, TRUNK_JSON,
};

use super::{bytes_bar, gb, hex, progress_line, remove_if_exists, sync_dir, write_atomic, Fail};

/// Stored data while coding.
const PARTIAL: &str = "trunk.k3z.partial";
/// Journal while coding.
const JOURNAL: &str = "trunk.k3z.partial.json";
/// The coded lm_head while coding.
const HEAD_PARTIAL: &str = "lm_head.k3z.partial";
/// Test hook: the most bytes of a coded lm_head chunk ([`head_chunk_cap`]).
const HEAD_CHUNK_ENV: &str = "K3_TEST_HEAD_CHUNK_BYTES";
/// lm_head rows coded per batch (whole chunks of them): a bounded buffer at any vocabulary.
const HEAD_BATCH_CHUNKS: u64 = 32;

/// The journal of an unfinished coding phase.
#[derive(Debug, Serialize, Deserialize)]
struct Journal {
    /// sha256 of the raw manifest's JSON and the codec's name.
    digest: String,
    done: Vec<CodedLayer>,
}

fn digest(raw_json: &[u8], codec: Codec) -> String {
    let mut h = Sha256::new();
    h.update(raw_json);
    h.update(codec.name().as_bytes());
    hex(&h.finalize())
}

/// The coded layers already written (journal matching `digest`, data file long enough).
fn resume(dir: &Path, digest: &str, layers: usize) -> Vec<CodedLayer> {
    let Ok(text) = fs::read_to_string(dir.join(JOURNAL)) else {
        return Vec::new();
    };
    let Ok(j) = serde_json::from_str::<Journal>(&text) else {
        tracing::info!("{JOURNAL} is unreadable: coding from the start");
        return Vec::new();
    };
    let need = j
        .done
        .last()
        .map(|d| d.offset + d.padded_length)
        .unwrap_or(0);
    let have = fs::metadata(dir.join(PARTIAL))
        .map(|m| m.len())
        .unwrap_or(0);
    if j.digest != digest || j.done.len() > layers || have < need {
        tracing::info!("{JOURNAL} is from another trunk or codec: coding from the start");
        return Vec::new();
    }
    j.done
}

/// Code the complete raw trunk in `dir` with `codec`, searching at `effort`, resumably;
/// commit it.
pub(super) fn code(
    dir: &Path,
    cat: &Catalog,
    codec: Codec,
    effort: Effort,
    stop_after: Option<usize>,
    head_cap: u64,
) -> Result<(), Fail> {
    let raw_json = fs::read(dir.join(TRUNK_JSON)).context("reading the raw trunk.json")?;
    let m = TrunkManifest::load_dir(dir).map_err(|e| Fail::Failed(anyhow!("{e}")))?;
    if m.codec.is_some() {
        return Err(Fail::Failed(anyhow!(
            "internal: the trunk is coded already"
        )));
    }
    let digest = digest(&raw_json, codec);
    let mut done = resume(dir, &digest, m.layers.len());
    if done.is_empty() {
        remove_if_exists(&dir.join(JOURNAL))?;
        remove_if_exists(&dir.join(PARTIAL))?;
    } else {
        tracing::info!(
            "resuming the coding: {} of {} layers done",
            done.len(),
            m.layers.len()
        );
    }
    let part_path = dir.join(PARTIAL);
    let out = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&part_path)
        .with_context(|| format!("opening {}", part_path.display()))?;
    let mut end = done.last().map(|d| d.offset + d.padded_length).unwrap_or(0);
    out.set_len(end)
        .with_context(|| format!("truncating {}", part_path.display()))?;
    let bin = dir.join(TRUNK_BIN);
    let input = File::open(&bin).with_context(|| format!("opening {}", bin.display()))?;
    let checks = m.run_checks();
    let start = Instant::now();
    let already: u64 = m.layers.iter().take(done.len()).map(|l| l.length).sum();
    let bar = bytes_bar("pack-trunk --codec", m.total_bytes, already);
    let every = if m.layers.len() > 20 { 10 } else { 1 };
    let (mut coded_raw, mut coded_stored) = (0u64, 0u64);
    let mut run = Vec::new();
    for l in m.layers.iter().skip(done.len()) {
        if stop_after == Some(done.len()) {
            bar.finish_and_clear();
            return Err(Fail::Failed(anyhow!(
                "stopped after coding {} layers (--stop-after-coded-layers)",
                done.len()
            )));
        }
        run.resize(l.length as usize, 0);
        input
            .read_exact_at(&mut run, l.offset)
            .with_context(|| format!("reading layer {} of {}", l.layer, bin.display()))?;
        // Code only the bytes that were packed.
        checks[l.layer]
            .check(&run)
            .map_err(|e| Fail::Failed(e.into()))?;
        bar.set_message(format!("coding layer {}", l.layer));
        let (bytes, mut cl) = encode_run(codec, l.layer, &run, m.align, effort)
            .map_err(|e| Fail::Failed(anyhow!("layer {}: {e}", l.layer)))?;
        cl.offset = end;
        out.write_all_at(&bytes, end)
            .with_context(|| format!("writing {}", part_path.display()))?;
        out.sync_data()
            .with_context(|| format!("fsync {}", part_path.display()))?;
        end += cl.padded_length;
        coded_raw += l.length;
        coded_stored += cl.chunks.iter().map(|c| c.stored).sum::<u64>();
        done.push(cl);
        let j = Journal {
            digest: digest.clone(),
            done: done.clone(),
        };
        write_atomic(
            &dir.join(JOURNAL),
            &serde_json::to_vec(&j).map_err(anyhow::Error::from)?,
        )?;
        bar.inc(l.length);
        if done.len().is_multiple_of(every) || done.len() == m.layers.len() {
            let s = start.elapsed().as_secs_f64();
            progress_line(
                &bar,
                format!(
                    "  coded {}/{} layers, {} stored for {} ({:.3}), {:.1} s ({:.0} MB/s)",
                    done.len(),
                    m.layers.len(),
                    gb(coded_stored),
                    gb(coded_raw),
                    coded_stored as f64 / coded_raw.max(1) as f64,
                    s,
                    coded_raw as f64 / 1e6 / s.max(1e-9)
                ),
            );
        }
    }
    bar.finish_and_clear();
    let head = code_head(dir, cat, codec, effort, m.align, head_cap)?;
    let stored_bytes = commit(dir, &m, codec, done, end, head)?;
    println!(
        "coded {} with {} ({effort}): {} stored for {} raw ({:.3}), in {:.1} s",
        dir.join(CODED_BIN).display(),
        codec.name(),
        gb(stored_bytes),
        gb(m.total_bytes),
        stored_bytes as f64 / m.total_bytes.max(1) as f64,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Code the checkpoint's lm_head (a BF16 matrix) into `lm_head.k3z.partial` in chunks of
/// whole rows, `HEAD_BATCH_CHUNKS` chunks read and coded at a time (on every core). None
/// (nothing written) when the checkpoint has no lm_head of its own or it is not BF16.
/// `head_cap`: the most bytes of a chunk ([`head_chunk_cap`]).
fn code_head(
    dir: &Path,
    cat: &Catalog,
    codec: Codec,
    effort: Effort,
    align: u64,
    head_cap: u64,
) -> Result<Option<CodedHead>, Fail> {
    let part = dir.join(HEAD_PARTIAL);
    remove_if_exists(&part)?;
    let Some(e) = cat.get(LM_HEAD) else {
        tracing::info!("the checkpoint has no {LM_HEAD} of its own: no coded lm_head");
        return Ok(None);
    };
    let (rows, cols) = match e.shape {
        [r, c] if e.dtype == Dtype::BF16 && *c > 0 => (*r as u64, *c as u64),
        _ => {
            tracing::info!(
                "{LM_HEAD} is {} {:?}, not a BF16 matrix: no coded lm_head",
                e.dtype,
                e.shape
            );
            return Ok(None);
        }
    };
    let row = cols * 2;
    let chunk_rows = head_chunk_rows(row, head_cap);
    let shard = &cat.shards()[e.shard].path;
    let input = File::open(shard).with_context(|| format!("opening {}", shard.display()))?;
    let out = File::create(&part).with_context(|| format!("creating {}", part.display()))?;
    let start = Instant::now();
    let (mut chunks, mut end, mut sha) = (Vec::<CodedChunk>::new(), 0u64, Sha256::new());
    let mut raw = Vec::new();
    let batch = chunk_rows * HEAD_BATCH_CHUNKS;
    let mut r0 = 0u64;
    while r0 < rows {
        let r1 = (r0 + batch).min(rows);
        raw.resize(((r1 - r0) * row) as usize, 0);
        input
            .read_exact_at(&mut raw, e.offset + r0 * row)
            .with_context(|| format!("reading {LM_HEAD} rows {r0}..{r1}"))?;
        sha.update(&raw);
        let (bytes, cs) = encode_head_rows(codec, &raw, row, chunk_rows, align, effort)
            .map_err(|x| Fail::Failed(anyhow!("{LM_HEAD} rows {r0}..{r1}: {x}")))?;
        out.write_all_at(&bytes, end)
            .with_context(|| format!("writing {}", part.display()))?;
        chunks.extend(cs.into_iter().map(|c| CodedChunk {
            offset: c.offset + end,
            ..c
        }));
        end += bytes.len() as u64;
        r0 = r1;
    }
    out.sync_data()
        .with_context(|| format!("fsync {}", part.display()))?;
    let stored_bytes = chunks.iter().map(|c| c.stored).sum();
    println!(
        "coded the lm_head ({rows} rows): {} stored for {} raw ({:.3}), in {:.1} s",
        gb(stored_bytes),
        gb(rows * row),
        stored_bytes as f64 / (rows * row).max(1) as f64,
        start.elapsed().as_secs_f64()
    );
    Ok(Some(CodedHead {
        tensor: LM_HEAD.to_string(),
        dtype: Dtype::BF16,
        shape: vec![rows as usize, cols as usize],
        chunk_rows,
        file: CODED_HEAD_BIN.to_string(),
        file_size: end,
        stored_bytes,
        sha256: hex(&sha.finalize()),
        chunks,
    }))
}

/// The most bytes of one coded lm_head chunk: `CODEC_CHUNK`, or fewer with the test hook
/// `K3_TEST_HEAD_CHUNK_BYTES` (armed by `K3_TEST_HOOKS=1`, refused otherwise, as a run's
/// hooks are), so the tiny model's head codes into several chunks.
pub(super) fn head_chunk_cap() -> Result<u64, Fail> {
    crate::run::launch::numeric_hook(HEAD_CHUNK_ENV)
        .map(|n| n.unwrap_or(CODEC_CHUNK))
        .map_err(|e| Fail::Refused(e.to_string()))
}

/// A complete coded trunk packed before the lm_head was coded: code the lm_head and commit
/// it into the manifest (the layers stay as they are). Returns whether a head was added.
pub(super) fn add_head(
    dir: &Path,
    cat: &Catalog,
    m: &TrunkManifest,
    effort: Effort,
    head_cap: u64,
) -> Result<bool, Fail> {
    let Some(c) = &m.codec else { return Ok(false) };
    if c.head.is_some() {
        return Ok(false);
    }
    let codec = Codec::from_name(&c.name).ok_or_else(|| anyhow!("unknown codec {}", c.name))?;
    let Some(head) = code_head(dir, cat, codec, effort, m.align, head_cap)? else {
        return Ok(false);
    };
    let mut coded = m.clone();
    if let Some(c) = coded.codec.as_mut() {
        c.head = Some(head);
    }
    consistent(&coded)?;
    fs::rename(dir.join(HEAD_PARTIAL), dir.join(CODED_HEAD_BIN))
        .with_context(|| format!("renaming {HEAD_PARTIAL} to {CODED_HEAD_BIN}"))?;
    sync_dir(dir);
    let json = serde_json::to_vec_pretty(&coded).map_err(anyhow::Error::from)?;
    write_atomic(&dir.join(TRUNK_JSON), &json)?;
    sync_dir(dir);
    Ok(true)
}

/// A coded manifest about to be committed has no problem (an internal error otherwise).
fn consistent(coded: &TrunkManifest) -> Result<(), Fail> {
    let problems = coded.problems();
    if !problems.is_empty() {
        return Err(Fail::Failed(anyhow!(
            "internal: the coded manifest is inconsistent: {}",
            problems.join("; ")
        )));
    }
    Ok(())
}

/// Commit the coded trunk whose layers `done` fill `trunk.k3z.partial` up to `end`: the
/// data renamed to `trunk.k3z`, then the coded manifest (from the raw one, `m`) replacing
/// `trunk.json`, and only then the raw `trunk.bin` and the journal removed (`head`: the
/// coded lm_head in `lm_head.k3z.partial`, renamed with the data). Returns the stored
/// bytes of the layers.
fn commit(
    dir: &Path,
    m: &TrunkManifest,
    codec: Codec,
    done: Vec<CodedLayer>,
    end: u64,
    head: Option<CodedHead>,
) -> Result<u64, Fail> {
    let stored_bytes = done.iter().flat_map(|l| &l.chunks).map(|c| c.stored).sum();
    let has_head = head.is_some();
    let mut coded = m.clone();
    coded.format = TRUNK_CODED_FORMAT.to_string();
    coded.codec = Some(TrunkCodec {
        name: codec.name().to_string(),
        chunk: CODEC_CHUNK,
        file: CODED_BIN.to_string(),
        file_size: end,
        stored_bytes,
        layers: done,
        head,
    });
    consistent(&coded)?;
    fs::rename(dir.join(PARTIAL), dir.join(CODED_BIN))
        .with_context(|| format!("renaming {PARTIAL} to {CODED_BIN}"))?;
    if has_head {
        fs::rename(dir.join(HEAD_PARTIAL), dir.join(CODED_HEAD_BIN))
            .with_context(|| format!("renaming {HEAD_PARTIAL} to {CODED_HEAD_BIN}"))?;
    } else {
        remove_if_exists(&dir.join(CODED_HEAD_BIN))?;
    }
    sync_dir(dir);
    let json = serde_json::to_vec_pretty(&coded).map_err(anyhow::Error::from)?;
    write_atomic(&dir.join(TRUNK_JSON), &json)?;
    remove_if_exists(&dir.join(TRUNK_BIN))?;
    remove_if_exists(&dir.join(JOURNAL))?;
    sync_dir(dir);
    Ok(stored_bytes)
}

/// Check every stored chunk's CRC (the cheap scan of an existing coded trunk).
pub(super) fn scan(dir: &Path, m: &TrunkManifest) -> Result<()> {
    let c = m
        .codec
        .as_ref()
        .ok_or_else(|| anyhow!("not a coded trunk"))?;
    let path = dir.join(&c.file);
    let f = File::open(&path).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let mut buf = Vec::new();
    for cl in &c.layers {
        for (k, ch) in cl.chunks.iter().enumerate() {
            buf.resize(ch.stored as usize, 0);
            f.read_exact_at(&mut buf, cl.offset + ch.offset)?;
            check_stored(cl.layer, k, ch, &buf)?;
        }
    }
    if let Some(h) = &c.head {
        let path = dir.join(&h.file);
        let f = File::open(&path).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        for (k, ch) in h.chunks.iter().enumerate() {
            buf.resize(ch.stored as usize, 0);
            f.read_exact_at(&mut buf, ch.offset)?;
            check_stored(Unit::Head, k, ch, &buf)?;
        }
    }
    Ok(())
}

/// `--verify` of a coded trunk: every problem found, one per entry.
pub(super) fn verify_layers(dir: &Path, m: &TrunkManifest) -> Result<Vec<String>> {
    let c = m
        .codec
        .as_ref()
        .ok_or_else(|| anyhow!("not a coded trunk"))?;
    let codec = Codec::from_name(&c.name).ok_or_else(|| anyhow!("unknown codec {}", c.name))?;
    let path = dir.join(&c.file);
    let f = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let checks = m.run_checks();
    let mut bad = Vec::new();
    let (mut stored, mut run) = (Vec::new(), Vec::new());
    let mut dec = Decoder::new();
    for (cl, l) in c.layers.iter().zip(&m.layers) {
        stored.resize(cl.padded_length as usize, 0);
        f.read_exact_at(&mut stored, cl.offset)
            .with_context(|| format!("reading layer {} of {}", cl.layer, path.display()))?;
        run.clear();
        run.resize(l.length as usize, 0);
        let mut gaps_zero = true;
        let mut at = 0usize;
        let mut ok = true;
        for (k, ch) in cl.chunks.iter().enumerate() {
            let (o, n) = (ch.offset as usize, ch.stored as usize);
            gaps_zero &= stored[at..o].iter().all(|&b| b == 0);
            at = o + n;
            let r0 = k * CODEC_CHUNK as usize;
            let dst = &mut run[r0..r0 + ch.raw as usize];
            if let Err(e) = decode_chunk(&mut dec, codec, cl.layer, k, ch, &stored[o..o + n], dst) {
                bad.push(e.to_string());
                ok = false;
            }
        }
        gaps_zero &= stored[at..].iter().all(|&b| b == 0);
        if !gaps_zero {
            bad.push(format!(
                "layer {}: padding between or after the chunks is not zero",
                l.layer
            ));
        }
        if !ok {
            continue;
        }
        if let Err(e) = checks[l.layer].check(&run) {
            bad.push(e.to_string());
        }
        if hex(&Sha256::digest(&run)) != l.sha256 {
            bad.push(format!(
                "layer {}: sha256 of the decoded run mismatch",
                l.layer
            ));
        }
    }
    if let Some(h) = &c.head {
        verify_head(dir, codec, h, &mut bad)?;
    }
    Ok(bad)
}

/// `--verify` of the coded lm_head: every chunk's two CRCs, the padding, the sha256 of the
/// decoded rows; problems appended to `bad`.
fn verify_head(dir: &Path, codec: Codec, h: &CodedHead, bad: &mut Vec<String>) -> Result<()> {
    let path = dir.join(&h.file);
    let f = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let mut stored = vec![0u8; h.file_size as usize];
    f.read_exact_at(&mut stored, 0)
        .with_context(|| format!("reading {}", path.display()))?;
    let (mut sha, mut dec, mut out) = (Sha256::new(), Decoder::new(), Vec::new());
    let (mut at, mut ok, mut gaps_zero) = (0usize, true, true);
    for (k, ch) in h.chunks.iter().enumerate() {
        let (o, n) = (ch.offset as usize, ch.stored as usize);
        gaps_zero &= stored[at..o].iter().all(|&b| b == 0);
        at = o + n;
        out.resize(ch.raw as usize, 0);
        match decode_chunk(
            &mut dec,
            codec,
            Unit::Head,
            k,
            ch,
            &stored[o..o + n],
            &mut out,
        ) {
            Ok(()) => sha.update(&out),
            Err(e) => {
                bad.push(e.to_string());
                ok = false;
            }
        }
    }
    gaps_zero &= stored[at..].iter().all(|&b| b == 0);
    if !gaps_zero {
        bad.push("coded lm_head: padding between or after the chunks is not zero".into());
    }
    if ok && hex(&sha.finalize()) != h.sha256 {
        bad.push("coded lm_head: sha256 of the decoded rows mismatch".into());
    }
    Ok(())
}
