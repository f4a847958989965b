//! Shared by the e2e test modules (one binary, `main.rs`): the built binary, fixture paths, oracle readers, a run
//! helper, visible skips, and running k3-orch inside a memory cgroup of its own.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_k3-orch")
}

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

pub fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(
        &std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

pub fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// (prompt_ids, generated ids) of an expected-*.json oracle file.
pub fn oracle(rel: &str) -> (Vec<u32>, Vec<u32>) {
    let v = json(&fixtures().join(rel));
    let (p, f) = (u32s(&v["prompt_ids"]), u32s(&v["full_ids"]));
    let g = f[p.len()..].to_vec();
    (p, g)
}

/// Rows of a float32 `.npy` oracle file (FIXTURES.md: data at byte 10 + header length).
pub fn npy_rows(rel: &str, vocab: usize) -> Vec<Vec<f32>> {
    let b = std::fs::read(fixtures().join(rel)).unwrap();
    assert_eq!(&b[..6], b"\x93NUMPY", "{rel}");
    let n = u16::from_le_bytes([b[8], b[9]]) as usize;
    let data = f32s(&b[10 + n..]);
    assert_eq!(data.len() % vocab, 0, "{rel}");
    data.chunks(vocab).map(|r| r.to_vec()).collect()
}

/// Little-endian f32 values (a --dump-logits file).
pub fn f32s(b: &[u8]) -> Vec<f32> {
    assert_eq!(b.len() % 4, 0, "not a whole number of f32");
    b.chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn join(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Largest |a − b|; NaN when any element is NaN (so `d <= tol` fails), lengths checked.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    assert!(!a.is_empty(), "nothing to compare");
    let mut w = 0f32;
    for (x, y) in a.iter().zip(b) {
        let d = (x - y).abs();
        if d.is_nan() {
            return f32::NAN;
        }
        w = w.max(d);
    }
    w
}

/// Bit-for-bit equality, lengths first (an empty side never passes).
pub fn assert_bits_eq(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    assert!(!a.is_empty(), "{what}: nothing to compare");
    if let Some(i) = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
    {
        panic!("{what}: differs at [{i}]: {} vs {}", a[i], b[i]);
    }
}

/// Run k3-orch with `args`; returns its output.
pub fn run(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .output()
        .expect("run k3-orch")
}

pub fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A test that cannot run here says so where a green run shows it: a `SKIPPED:` line on
/// the real stderr (libtest captures only the print macros), which .ci/run collects and
/// summarises. With K3_REQUIRE_PRIVILEGED_TESTS=1 (CI, which runs as root) a skip is a
/// failure instead, so a cgroup or NUMA test cannot silently stop running.
pub fn skip(test: &str, why: &str) {
    if std::env::var("K3_REQUIRE_PRIVILEGED_TESTS").as_deref() == Ok("1") {
        panic!("{test} cannot run ({why}) and K3_REQUIRE_PRIVILEGED_TESTS=1");
    }
    let _ = writeln!(std::io::stderr(), "SKIPPED: {test}: {why}");
}

/// This process's memory cgroup directory (v1 or v2).
pub fn memory_cgroup_dir() -> Option<PathBuf> {
    let s = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for l in s.lines() {
        let mut f = l.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        if ctrl.split(',').any(|c| c == "memory") {
            return Some(PathBuf::from("/sys/fs/cgroup/memory").join(path.trim_start_matches('/')));
        }
    }
    s.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| PathBuf::from("/sys/fs/cgroup").join(p.trim_start_matches('/')))
}

/// A memory cgroup with a limit, made for one test and removed when dropped.
pub struct TestCgroup {
    pub dir: PathBuf,
    pub v2: bool,
}

impl TestCgroup {
    /// Err says why no cgroup could be made (the caller skips).
    pub fn new(name: &str, limit_bytes: u64) -> Result<TestCgroup, String> {
        let parent = memory_cgroup_dir().ok_or("no memory cgroup for this process")?;
        let v2 = !parent.starts_with("/sys/fs/cgroup/memory");
        let dir = parent.join(format!("k3-test-{name}-{}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| {
            format!(
                "cannot create a memory cgroup under {}: {e}",
                parent.display()
            )
        })?;
        let cg = TestCgroup { dir, v2 };
        let (limit, swap) = if v2 {
            ("memory.max", "memory.swap.max")
        } else {
            ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        };
        std::fs::write(cg.dir.join(limit), limit_bytes.to_string())
            .map_err(|e| format!("cannot set {limit}: {e}"))?;
        // No swap, so the limit is the limit (v1: memsw = mem; v2: swap.max 0).
        let _ = std::fs::write(
            cg.dir.join(swap),
            if v2 {
                "0".to_string()
            } else {
                limit_bytes.to_string()
            },
        );
        Ok(cg)
    }

    /// Run k3-orch with `args` as a member of this cgroup (a shell joins it, then execs).
    pub fn run(&self, args: &[&str]) -> Output {
        let procs = self.dir.join("cgroup.procs");
        Command::new("sh")
            .arg("-c")
            .arg("echo $$ > \"$0\" && exec \"$@\"")
            .arg(&procs)
            .arg(bin())
            .args(args)
            .output()
            .expect("run k3-orch in a cgroup")
    }

    /// OOM kills inside this cgroup (and its children) so far.
    pub fn oom_kills(&self) -> u64 {
        let (file, key) = if self.v2 {
            ("memory.events", "oom_kill ")
        } else {
            ("memory.oom_control", "oom_kill ")
        };
        std::fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // The run's own k3-<pid> groups are its to remove; wait briefly for the kernel.
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}
