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

use k3_model::codec::{Codec, Decoder, Effort};
use k3_model::codec_trunk::{check_stored, decode_chunk, encode_run};
use k3_model::trunk::{
    CodedLayer, TrunkCodec, TrunkManifest, CODEC_CHUNK, CODED_BIN, TRUNK_BIN, TRUNK_CODED_FORMAT,
    TRUNK_JSON,
};

use super::{bytes_bar, gb, hex, progress_line, remove_if_exists, sync_dir, write_atomic, Fail};

/// Stored data while coding.
const PARTIAL: &str = "trunk.k3z.partial";
/// Journal while coding.
const JOURNAL: &str = "trunk.k3z.partial.json";

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
    codec: Codec,
    effort: Effort,
    stop_after: Option<usize>,
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
    let stored_bytes = commit(dir, &m, codec, done, end)?;
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

/// Commit the coded trunk whose layers `done` fill `trunk.k3z.partial` up to `end`: the
/// data renamed to `trunk.k3z`, then the coded manifest (from the raw one, `m`) replacing
/// `trunk.json`, and only then the raw `trunk.bin` and the journal removed. Returns the
/// stored bytes.
fn commit(
    dir: &Path,
    m: &TrunkManifest,
    codec: Codec,
    done: Vec<CodedLayer>,
    end: u64,
) -> Result<u64, Fail> {
    let stored_bytes = done.iter().flat_map(|l| &l.chunks).map(|c| c.stored).sum();
    let mut coded = m.clone();
    coded.format = TRUNK_CODED_FORMAT.to_string();
    coded.codec = Some(TrunkCodec {
        name: codec.name().to_string(),
        chunk: CODEC_CHUNK,
        file: CODED_BIN.to_string(),
        file_size: end,
        stored_bytes,
        layers: done,
    });
    let problems = coded.problems();
    if !problems.is_empty() {
        return Err(Fail::Failed(anyhow!(
            "internal: the coded manifest is inconsistent: {}",
            problems.join("; ")
        )));
    }
    fs::rename(dir.join(PARTIAL), dir.join(CODED_BIN))
        .with_context(|| format!("renaming {PARTIAL} to {CODED_BIN}"))?;
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
    Ok(bad)
}
