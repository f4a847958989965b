//! `k3-orch pack-experts MODEL_DIR --to DIR [DIR...] [--copies N | --split] [--verify]
//! [--force]`:
//! copy every routed expert into `experts.bin` files, one aligned run per expert (its
//! tensors back to back, as in the shard), striped over the directories balanced by bytes,
//! each directory meant to be on its own drive and described by its own `experts.json`
//! (format and striping: `k3_model::experts`). With `--copies N` each expert is written to N
//! of the directories (N times the space), and a run reads it from whichever of them is
//! least busy. With `--split` every expert is cut into page-aligned parts, one in each
//! directory, so each expert is read from every drive at once (the same space as plain
//! stripes). Run with `k3-orch MODEL --experts DIR,...`.
//!
//! Refused up front (exit 2), naming the directory: one that does not exist (a drive not
//! mounted), is not a directory, is read-only (a read-only mount, no write permission, or a
//! probe file cannot be created), lacks the room for its share, or holds experts packed from
//! another checkpoint (`--force` re-packs); a directory given twice; more copies than
//! directories; a checkpoint whose experts are not one run each.
//!
//! Crash safety, per directory: data goes to `experts.bin.partial`; after every 64 MiB of
//! experts (and at the end) the data is fsynced and then one line per expert (its sha256)
//! appended to the journal `experts.partial.jsonl`, whose first line is the plan's digest.
//! A re-run with the same plan resumes after the last journaled expert (the data file is
//! cut back to it; a torn last line is ignored); anything else restarts that directory.
//! Only when every directory's data is in and fsynced is each renamed to `experts.bin` and
//! its `experts.json` written (temp name, fsync, rename): the manifest is the commit marker,
//! and a directory already committed with this plan is left as it is.
//!
//! `--verify` opens the pack as a run does (one pack, every stripe, the checkpoint's
//! identity and expert table), re-reads every run and checks its sha256 and zero padding.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, Context};
use clap::Parser;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::pack_trunk::{
    advise, lock_tool_dir, remove_if_exists, sync_dir, write_atomic, Fail, WriteFlow,
};
use k3_model::catalog::Catalog;
use k3_model::experts::{
    expert_runs, split_runs, stripe_copies, ExpertRun, ExpertsManifest, PackedExpert,
    PackedExperts, EXPERTS_ALIGN, EXPERTS_BIN, EXPERTS_FORMAT, EXPERTS_FORMAT_SPLIT, EXPERTS_JSON,
};
use k3_model::trunk::{align_up, SourceIdentity};

/// Data file while packing.
const PARTIAL_BIN: &str = "experts.bin.partial";
/// Journal while packing.
const JOURNAL: &str = "experts.partial.jsonl";
/// Bytes of experts between two journal commits.
const FLUSH_BYTES: u64 = 64 << 20;

/// Command line of `k3-orch pack-experts`.
#[derive(Parser, Debug)]
#[command(
    name = "k3-orch pack-experts",
    about = "Pack the routed experts over one or more directories (one per drive), one aligned run per expert"
)]
struct Args {
    /// The checkpoint directory (model.safetensors.index.json + shards).
    model_dir: PathBuf,
    /// Output directories, each on its own drive (each must exist); the experts are
    /// striped over them balanced by bytes.
    #[arg(long = "to", required = true, num_args = 1..)]
    to: Vec<PathBuf>,
    /// Write each expert to this many of the directories (at most one per directory):
    /// N times the space; a run reads each expert from whichever of its drives has the
    /// fewest of the layer's reads, so no drive reads much more than its share.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    copies: u32,
    /// Split every expert into page-aligned parts, one per directory: each expert is read
    /// from every drive at once, so each drive reads its share of every layer (whole
    /// experts striped leave the busiest drive about 1.2 times its share), in the same
    /// space as plain stripes.
    #[arg(long, conflicts_with = "copies")]
    split: bool,
    /// Re-read every expert and check it against experts.json and the checkpoint.
    #[arg(long)]
    verify: bool,
    /// Re-pack even when the directories already hold a complete pack of this checkpoint,
    /// or a pack of another one.
    #[arg(long)]
    force: bool,
    /// Testing: stop (exit 1) after this many experts in each directory, as if interrupted.
    #[arg(long, hide = true)]
    stop_after_experts: Option<usize>,
}

pub fn main(args: Vec<OsString>) -> i32 {
    let args = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    match run(&args) {
        Ok(()) => 0,
        Err(f) => f.report("pack-experts"),
    }
}

/// One directory's share of the plan: its experts in file order (sha256 not yet known).
#[derive(Clone, Debug, Serialize)]
struct Stripe {
    #[serde(skip)]
    dir: PathBuf,
    experts: Vec<PackedExpert>,
}

impl Stripe {
    /// Bytes of the data file when complete.
    fn file_size(&self) -> u64 {
        self.experts
            .last()
            .map_or(0, |x| x.offset + x.padded_length())
    }
}

/// What every directory's manifest says of the whole pack.
struct PackHead<'a> {
    stripes: usize,
    /// Distinct experts.
    total_experts: usize,
    copies: usize,
    split: bool,
    src: &'a SourceIdentity,
    digest: &'a str,
}

/// The first line of a journal.
#[derive(Debug, Serialize, Deserialize)]
struct JournalHead {
    plan_sha256: String,
    stripe: usize,
}

/// Each further line of a journal: one expert done, in file order.
#[derive(Debug, Serialize, Deserialize)]
struct JournalLine {
    sha256: String,
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn gb(b: u64) -> String {
    format!("{:.2} GB", b as f64 / 1e9)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Lay the runs out over the directories, `copies` of each ([`stripe_copies`]) or each split
/// into one part a directory ([`split_runs`]), each run or part at the next aligned offset
/// of its directory.
fn plan(
    cat: &Catalog,
    runs: &[ExpertRun],
    dirs: &[PathBuf],
    (copies, split): (usize, bool),
) -> Vec<Stripe> {
    let shards = cat.shards();
    // Per directory: (run, part offset in it, part length), in file order.
    let layout: Vec<Vec<(usize, u64, u64)>> = if split {
        (split_runs(runs, dirs.len()).into_iter())
            .map(|ps| ps.into_iter().map(|p| (p.run, p.from, p.length)).collect())
            .collect()
    } else {
        (stripe_copies(runs, dirs.len(), copies).into_iter())
            .map(|idx| idx.into_iter().map(|i| (i, 0, runs[i].length)).collect())
            .collect()
    };
    layout
        .into_iter()
        .zip(dirs)
        .map(|(parts, dir)| {
            let mut offset = 0u64;
            let experts = parts
                .into_iter()
                .map(|(i, from, length)| {
                    let r = &runs[i];
                    let x = PackedExpert {
                        layer: r.layer,
                        expert: r.expert,
                        offset,
                        length,
                        shard: file_name(&shards[r.shard].path),
                        source_offset: r.source_offset + from,
                        sha256: String::new(),
                        part_offset: from,
                    };
                    offset += align_up(length, EXPERTS_ALIGN);
                    x
                })
                .collect();
            Stripe {
                dir: dir.clone(),
                experts,
            }
        })
        .collect()
}

/// The manifests' format string: whole experts, or split ones.
fn format(split: bool) -> &'static str {
    if split {
        EXPERTS_FORMAT_SPLIT
    } else {
        EXPERTS_FORMAT
    }
}

/// The pack's id: the format, the checkpoint's identity and the whole plan.
fn plan_digest(plan: &[Stripe], src: &SourceIdentity, split: bool) -> String {
    let mut h = Sha256::new();
    h.update(format(split).as_bytes());
    h.update(serde_json::to_vec(src).unwrap_or_default());
    h.update(serde_json::to_vec(plan).unwrap_or_default());
    hex(&h.finalize())
}

fn run(a: &Args) -> Result<(), Fail> {
    check_dirs(&a.to)?;
    let copies = a.copies as usize;
    if copies > a.to.len() {
        return Err(Fail::Refused(format!(
            "--copies {copies} needs at least {copies} directories (one copy per directory, \
             each on its own drive); {} given",
            a.to.len()
        )));
    }
    let cat = Catalog::open(&a.model_dir).map_err(|e| {
        Fail::Refused(format!(
            "cannot catalog the checkpoint: {e} (run k3-orch verify)"
        ))
    })?;
    let src = SourceIdentity::of(&cat).map_err(|e| Fail::Refused(e.to_string()))?;
    let runs = expert_runs(&cat).map_err(|e| Fail::Refused(e.to_string()))?;
    let plan = plan(&cat, &runs, &a.to, (copies, a.split));
    let digest = plan_digest(&plan, &src, a.split);
    // One packer per directory: a second one would cut the first one's files.
    let mut locks = Vec::new();
    for d in &a.to {
        locks.push(lock_tool_dir(d, "pack-experts")?);
    }
    let todo = to_pack(a, &plan, &digest, &src)?;
    let total_experts = runs.len();
    if todo.is_empty() {
        println!(
            "{} already hold a complete pack of this checkpoint ({} experts); nothing to pack \
             (--force re-packs)",
            a.to.len(),
            total_experts
        );
    } else {
        check_room(&plan, &todo)?;
        // From here on no directory being packed may look complete until it is committed.
        for &i in &todo {
            remove_if_exists(&plan[i].dir.join(EXPERTS_JSON))?;
            sync_dir(&plan[i].dir);
        }
        let head = PackHead {
            stripes: plan.len(),
            total_experts,
            copies,
            split: a.split,
            src: &src,
            digest: &digest,
        };
        pack(a, &cat, &plan, &todo, &head)?;
    }
    if a.verify {
        verify(&a.to, &cat)?;
    }
    Ok(())
}

/// Refuse, naming it, a directory that is missing, not a directory, read-only, or given
/// twice.
fn check_dirs(dirs: &[PathBuf]) -> Result<(), Fail> {
    use std::os::unix::fs::PermissionsExt;
    let mut seen: Vec<(PathBuf, &PathBuf)> = Vec::new();
    for d in dirs {
        let meta = fs::metadata(d).map_err(|e| {
            Fail::Refused(format!(
                "{}: {} (each --to DIR must exist, on the drive it stands for: mount the \
                 drive and create the directory first)",
                d.display(),
                if e.kind() == std::io::ErrorKind::NotFound {
                    "no such directory".to_string()
                } else {
                    e.to_string()
                }
            ))
        })?;
        if !meta.is_dir() {
            return Err(Fail::Refused(format!("{} is not a directory", d.display())));
        }
        let canon = fs::canonicalize(d).unwrap_or_else(|_| d.clone());
        if let Some((_, first)) = seen.iter().find(|(c, _)| *c == canon) {
            return Err(Fail::Refused(format!(
                "{} and {} are the same directory (give each directory once)",
                first.display(),
                d.display()
            )));
        }
        seen.push((canon, d));
        let (_, read_only) =
            fs_space(d).map_err(|e| Fail::Refused(format!("{}: statvfs: {e}", d.display())))?;
        let why = if read_only {
            Some("its file system is mounted read-only".to_string())
        } else if meta.permissions().mode() & 0o222 == 0 {
            Some("it has no write permission".to_string())
        } else {
            tempfile::tempfile_in(d)
                .err()
                .map(|e| format!("a file cannot be created in it ({e})"))
        };
        if let Some(why) = why {
            return Err(Fail::Refused(format!(
                "{} is read-only: {why}",
                d.display()
            )));
        }
    }
    Ok(())
}

/// Free bytes for an unprivileged writer, and whether the file system is read-only, of the
/// file system holding `dir`.
fn fs_space(dir: &Path) -> std::io::Result<(u64, bool)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path alive for the call, and `st` points to writable
    // memory the size of a `statvfs`.
    let r = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs succeeded, so it filled `st` (and it was zeroed before).
    let st = unsafe { st.assume_init() };
    let free = st.f_bavail.saturating_mul(st.f_frsize);
    Ok((free, st.f_flag & libc::ST_RDONLY != 0))
}

/// The directories (by stripe) that need packing: not already committed with this plan
/// (all of them with `--force`). A directory holding a pack of another checkpoint is
/// refused without `--force`.
fn to_pack(
    a: &Args,
    plan: &[Stripe],
    digest: &str,
    src: &SourceIdentity,
) -> Result<Vec<usize>, Fail> {
    let mut todo = Vec::new();
    for (i, st) in plan.iter().enumerate() {
        let dir = &st.dir;
        if dir.join(EXPERTS_JSON).exists() {
            match ExpertsManifest::load_dir(dir) {
                Ok(m) if !a.force && m.source != *src => {
                    let diffs = m.source.diffs(src);
                    return Err(Fail::Refused(format!(
                        "{} holds experts packed from another checkpoint ({}); --force \
                         re-packs",
                        dir.display(),
                        if diffs.is_empty() {
                            "its source identity differs".to_string()
                        } else {
                            diffs.join("; ")
                        }
                    )));
                }
                Ok(m) if !a.force && m.pack_id == digest && m.stripe == i => continue,
                Ok(_) if !a.force => tracing::info!(
                    "{}: the existing pack has another layout; re-packing",
                    dir.display()
                ),
                Ok(_) => {}
                Err(e) => tracing::info!("existing pack is unusable ({e}); re-packing"),
            }
        }
        todo.push(i);
    }
    Ok(todo)
}

/// Refuse a directory whose file system cannot take its share (what a partial or old data
/// file of the pack already holds counts as room, since it is replaced).
fn check_room(plan: &[Stripe], todo: &[usize]) -> Result<(), Fail> {
    for &i in todo {
        let st = &plan[i];
        let (free, _) = fs_space(&st.dir)
            .map_err(|e| Fail::Refused(format!("{}: statvfs: {e}", st.dir.display())))?;
        let reused: u64 = [PARTIAL_BIN, EXPERTS_BIN]
            .iter()
            .filter_map(|f| fs::metadata(st.dir.join(f)).ok())
            .map(|m| m.len())
            .sum();
        let need = st.file_size();
        if free.saturating_add(reused) < need {
            return Err(Fail::Refused(format!(
                "{} is too full: its share of the experts needs {}, its file system has {} \
                 free",
                st.dir.display(),
                gb(need),
                gb(free.saturating_add(reused))
            )));
        }
    }
    Ok(())
}

/// Pack every directory of `todo` at once (one thread per directory, each drive writing
/// while the others do), then commit each.
fn pack(
    a: &Args,
    cat: &Catalog,
    plan: &[Stripe],
    todo: &[usize],
    head: &PackHead<'_>,
) -> Result<(), Fail> {
    let digest = head.digest;
    let total: u64 = todo
        .iter()
        .flat_map(|&i| &plan[i].experts)
        .map(|x| x.length)
        .sum();
    let bar = super::pack_trunk::bytes_bar("pack-experts", total, 0);
    let start = Instant::now();
    let results: Vec<Result<Vec<PackedExpert>, Fail>> = std::thread::scope(|s| {
        let handles: Vec<_> = todo
            .iter()
            .map(|&i| {
                let (st, bar) = (&plan[i], &bar);
                s.spawn(move || pack_dir(a, cat, i, st, digest, bar))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Fail::Failed(anyhow!("a packing thread panicked"))))
            })
            .collect()
    });
    bar.finish_and_clear();
    let mut done = Vec::new();
    for (&i, r) in todo.iter().zip(results) {
        done.push((i, r?));
    }
    for (i, experts) in done {
        let m = commit_dir(&plan[i].dir, i, head, experts)?;
        println!(
            "wrote {}: {} experts, {}",
            plan[i].dir.join(EXPERTS_BIN).display(),
            m.experts.len(),
            gb(m.total_bytes)
        );
    }
    let s = start.elapsed().as_secs_f64();
    println!(
        "packed {} experts{} over {} directories ({} copied in {s:.1} s, {:.0} MB/s)",
        head.total_experts,
        if head.copies > 1 {
            format!(", {} copies of each,", head.copies)
        } else if head.split {
            ", each split,".to_string()
        } else {
            String::new()
        },
        plan.len(),
        gb(total),
        total as f64 / 1e6 / s.max(1e-9)
    );
    Ok(())
}

/// The sha256 of the experts already packed in `st.dir` (from its journal, when it belongs
/// to this plan and stripe and the data file holds them), or none.
fn resume_point(st: &Stripe, digest: &str, i: usize) -> Vec<String> {
    let Ok(text) = fs::read_to_string(st.dir.join(JOURNAL)) else {
        return Vec::new();
    };
    let mut lines = text.lines();
    let head: Option<JournalHead> = lines.next().and_then(|l| serde_json::from_str(l).ok());
    if !head.is_some_and(|h| h.plan_sha256 == digest && h.stripe == i) {
        tracing::info!(
            "{}: {JOURNAL} is from another checkpoint or layout: starting over",
            st.dir.display()
        );
        return Vec::new();
    }
    // A torn last line (a crash while appending) ends the list.
    let shas: Vec<String> = lines
        .map_while(|l| serde_json::from_str::<JournalLine>(l).ok())
        .map(|l| l.sha256)
        .take(st.experts.len())
        .collect();
    let need = shas
        .len()
        .checked_sub(1)
        .map_or(0, |k| st.experts[k].offset + st.experts[k].padded_length());
    let have = fs::metadata(st.dir.join(PARTIAL_BIN)).map_or(0, |m| m.len());
    if have < need {
        tracing::info!(
            "{}: {JOURNAL} does not match {PARTIAL_BIN}: starting over",
            st.dir.display()
        );
        return Vec::new();
    }
    shas
}

/// Copy directory `i`'s experts into its partial data file, resuming where its journal
/// ends; returns its experts with their sha256.
fn pack_dir(
    a: &Args,
    cat: &Catalog,
    i: usize,
    st: &Stripe,
    digest: &str,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<PackedExpert>, Fail> {
    let dir = &st.dir;
    let mut shas = resume_point(st, digest, i);
    let (jpath, bin_path) = (dir.join(JOURNAL), dir.join(PARTIAL_BIN));
    if shas.is_empty() {
        remove_if_exists(&jpath)?;
        remove_if_exists(&bin_path)?;
        let head = JournalHead {
            plan_sha256: digest.to_string(),
            stripe: i,
        };
        let line = serde_json::to_string(&head).map_err(anyhow::Error::from)? + "\n";
        write_atomic(&jpath, line.as_bytes())?;
    } else {
        tracing::info!(
            "{}: resuming: {} of {} experts already packed",
            dir.display(),
            shas.len(),
            st.experts.len()
        );
    }
    let out = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&bin_path)
        .with_context(|| format!("opening {}", bin_path.display()))?;
    let keep = shas
        .len()
        .checked_sub(1)
        .map_or(0, |k| st.experts[k].offset + st.experts[k].padded_length());
    out.set_len(keep)
        .with_context(|| format!("truncating {}", bin_path.display()))?;
    let mut journal = OpenOptions::new()
        .append(true)
        .open(&jpath)
        .with_context(|| format!("opening {}", jpath.display()))?;
    bar.inc(st.experts[..shas.len()].iter().map(|x| x.length).sum());
    let mut copier = Copier::new(cat, &out, &bin_path);
    let (mut pending, mut pending_bytes) = (String::new(), 0u64);
    for x in &st.experts[shas.len()..] {
        let sha = copier.copy(x)?;
        let line = JournalLine {
            sha256: sha.clone(),
        };
        pending += &(serde_json::to_string(&line).map_err(anyhow::Error::from)? + "\n");
        shas.push(sha);
        pending_bytes += x.length;
        bar.inc(x.length);
        let stop = a.stop_after_experts == Some(shas.len());
        if pending_bytes >= FLUSH_BYTES || stop || shas.len() == st.experts.len() {
            commit_journal(&out, &bin_path, &mut journal, &jpath, &mut pending)?;
            pending_bytes = 0;
        }
        if stop && shas.len() < st.experts.len() {
            return Err(Fail::Failed(anyhow!(
                "{}: stopped after {} experts (--stop-after-experts)",
                dir.display(),
                shas.len()
            )));
        }
    }
    commit_journal(&out, &bin_path, &mut journal, &jpath, &mut pending)?;
    let mut experts = st.experts.clone();
    for (x, s) in experts.iter_mut().zip(shas) {
        x.sha256 = s;
    }
    Ok(experts)
}

/// Make the data written so far durable, then journal its experts (`pending` lines).
fn commit_journal(
    out: &File,
    bin_path: &Path,
    journal: &mut File,
    jpath: &Path,
    pending: &mut String,
) -> Result<(), Fail> {
    if pending.is_empty() {
        return Ok(());
    }
    out.sync_data()
        .with_context(|| format!("fsync {}", bin_path.display()))?;
    journal
        .write_all(pending.as_bytes())
        .and_then(|()| journal.sync_data())
        .with_context(|| format!("writing {}", jpath.display()))?;
    pending.clear();
    Ok(())
}

/// Copies experts from the shards into one data file.
struct Copier<'a> {
    cat: &'a Catalog,
    shards: BTreeMap<String, File>,
    out: &'a File,
    out_path: &'a Path,
    buf: Vec<u8>,
    flow: WriteFlow,
}

impl<'a> Copier<'a> {
    fn new(cat: &'a Catalog, out: &'a File, out_path: &'a Path) -> Copier<'a> {
        Copier {
            cat,
            shards: BTreeMap::new(),
            out,
            out_path,
            buf: Vec::new(),
            flow: WriteFlow::default(),
        }
    }

    /// Copy `x`'s run and its zero padding to `x.offset`; returns the run's sha256.
    fn copy(&mut self, x: &PackedExpert) -> Result<String, Fail> {
        if !self.shards.contains_key(&x.shard) {
            let path = self
                .cat
                .shards()
                .iter()
                .map(|s| &s.path)
                .find(|p| file_name(p) == x.shard)
                .ok_or_else(|| anyhow!("shard {} is not in the checkpoint", x.shard))?;
            let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
            self.shards.insert(x.shard.clone(), f);
        }
        let input = &self.shards[&x.shard];
        let padded = x.padded_length();
        self.buf.clear();
        self.buf.resize(padded as usize, 0);
        let run = &mut self.buf[..x.length as usize];
        input.read_exact_at(run, x.source_offset).with_context(|| {
            format!(
                "reading layer {} expert {} from {} at {}",
                x.layer, x.expert, x.shard, x.source_offset
            )
        })?;
        // The checkpoint's pages are not needed again: leave the cache to others.
        advise(input, x.source_offset, x.length, libc::POSIX_FADV_DONTNEED);
        let sha = hex(&Sha256::digest(&*run));
        self.out
            .write_all_at(&self.buf, x.offset)
            .with_context(|| format!("writing {}", self.out_path.display()))?;
        self.flow.wrote(self.out, x.offset, padded);
        Ok(sha)
    }
}

/// Commit directory `stripe`: its manifest checked, the partial file renamed into place,
/// the manifest written (the commit marker) and the journal removed.
fn commit_dir(
    dir: &Path,
    stripe: usize,
    head: &PackHead<'_>,
    experts: Vec<PackedExpert>,
) -> Result<ExpertsManifest, Fail> {
    let m = ExpertsManifest {
        format: format(head.split).to_string(),
        align: EXPERTS_ALIGN,
        pack_id: head.digest.to_string(),
        stripe,
        stripes: head.stripes,
        total_experts: head.total_experts,
        copies: head.copies,
        split: head.split,
        file: EXPERTS_BIN.to_string(),
        file_size: experts.last().map_or(0, |x| x.offset + x.padded_length()),
        total_bytes: experts.iter().map(|x| x.length).sum(),
        source: head.src.clone(),
        experts,
    };
    let problems = m.problems();
    if !problems.is_empty() {
        return Err(Fail::Failed(anyhow!(
            "internal: the manifest of {} is inconsistent: {}",
            dir.display(),
            problems.join("; ")
        )));
    }
    fs::rename(dir.join(PARTIAL_BIN), dir.join(EXPERTS_BIN))
        .with_context(|| format!("{}: renaming {PARTIAL_BIN} to {EXPERTS_BIN}", dir.display()))?;
    sync_dir(dir);
    let json = serde_json::to_vec_pretty(&m).map_err(anyhow::Error::from)?;
    write_atomic(&dir.join(EXPERTS_JSON), &json)?;
    remove_if_exists(&dir.join(JOURNAL))?;
    sync_dir(dir);
    Ok(m)
}

/// Check a pack as a run opens it, then every run's sha256 and zero padding.
fn verify(dirs: &[PathBuf], cat: &Catalog) -> Result<(), Fail> {
    let p = PackedExperts::open(dirs).map_err(|e| Fail::Failed(anyhow!(e)))?;
    p.check_against(cat).map_err(|e| Fail::Failed(anyhow!(e)))?;
    let start = Instant::now();
    let mut bad = Vec::new();
    let mut buf = Vec::new();
    let mut bytes = 0u64;
    for (dir, m) in p.dirs.iter().zip(&p.manifests) {
        let bin = dir.join(&m.file);
        let f = File::open(&bin).with_context(|| format!("opening {}", bin.display()))?;
        for x in &m.experts {
            buf.resize(x.padded_length() as usize, 0);
            f.read_exact_at(&mut buf, x.offset).with_context(|| {
                format!(
                    "reading layer {} expert {} of {}",
                    x.layer,
                    x.expert,
                    bin.display()
                )
            })?;
            let (run, pad) = buf.split_at(x.length as usize);
            let who = format!("{}: layer {} expert {}", bin.display(), x.layer, x.expert);
            if hex(&Sha256::digest(run)) != x.sha256 {
                bad.push(format!("{who}: sha256 mismatch (the bytes changed)"));
            }
            if pad.iter().any(|&b| b != 0) {
                bad.push(format!("{who}: padding after the run is not zero"));
            }
            bytes += x.length;
        }
    }
    let s = start.elapsed().as_secs_f64();
    if bad.is_empty() {
        println!(
            "verify: OK, {} {} over {} directories, {} re-read in {s:.1} s, every sha256 \
             matches",
            p.manifests.iter().map(|m| m.experts.len()).sum::<usize>(),
            if p.split() {
                "parts of experts"
            } else {
                "experts"
            },
            p.dirs.len(),
            gb(bytes)
        );
        Ok(())
    } else {
        Err(Fail::Failed(anyhow!(
            "verify FAILED:\n  {}",
            bad.join("\n  ")
        )))
    }
}
