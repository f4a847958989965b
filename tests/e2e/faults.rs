//! End-to-end fault tests of the staged pipeline (issue 5, item 6): a stage killed at a
//! random moment, a stage that stops answering, Ctrl-C, an injected expert read error, a
//! stage over its memory budget, and NUMA placement.
//!
//! Every run goes through the real `k3-orch` binary on the bundled tiny model. After each
//! fault the tests check what must be true of any correct supervisor: k3-orch exits
//! non-zero naming the stage and the cause, no stage process outlives it, and nothing it
//! created (cgroup directories, /dev/shm objects) is left behind. The time limits below are
//! the ("exits within 5 s"), checked generously against hangs, not speed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_k3-orch")
}

fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-mxfp4/sharded")
}

/// A long-ish run: 20 tokens with full recompute, so there is time to hit it.
fn start(extra: &[&str], envs: &[(&str, &str)]) -> Child {
    let mut c = Command::new(bin());
    c.arg(model())
        .args(["--ids", "1,2,3,4,5,6,7,8", "--gen", "20"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        c.env(k, v);
    }
    c.spawn().expect("start k3-orch")
}

/// (pid, stage) of the `k3-orch stage <name>` children of `parent`, from /proc.
fn stage_children(parent: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // ppid is the 2nd field after the parenthesised command name.
        let Some(rest) = stat.rsplit_once(')').map(|x| x.1) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.get(1).and_then(|p| p.parse::<u32>().ok()) != Some(parent) {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<String> = cmd
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.get(1).map(String::as_str) == Some("stage") {
            if let Some(name) = args.get(2) {
                out.push((pid, name.clone()));
            }
        }
    }
    out
}

/// Wait until all four stages are running (or the run ended).
fn wait_stages(child: &mut Child) -> Vec<(u32, String)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = stage_children(child.id());
        if s.len() == 4 || Instant::now() > deadline {
            return s;
        }
        if let Ok(Some(_)) = child.try_wait() {
            return s;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A process that still runs (exists and is not a zombie).
fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => {
            let state = s
                .rsplit_once(')')
                .and_then(|x| x.1.split_whitespace().next().map(str::to_string));
            state.as_deref() != Some("Z") && state.as_deref() != Some("X")
        }
        Err(_) => false,
    }
}

/// Wait for exit up to `limit`; returns (code or None for a signal, elapsed, stdout, stderr).
fn wait_exit(mut child: Child, limit: Duration) -> (Option<i32>, Duration, String, String) {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let o = child.wait_with_output().unwrap();
            return (
                st.code(),
                t0.elapsed(),
                String::from_utf8_lossy(&o.stdout).into_owned(),
                String::from_utf8_lossy(&o.stderr).into_owned(),
            );
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!(
                "k3-orch did not exit within {limit:?}\n{}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// This process's memory cgroup directory (v1 or v2), where runs make `k3-<pid>`.
fn memory_cgroup_dir() -> Option<PathBuf> {
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

/// After k3-orch (pid `orch`) is gone: none of `stages` runs, its cgroup directory is
/// removed, and no k3 object is left in /dev/shm.
fn assert_clean(orch: u32, stages: &[(u32, String)]) {
    // The kernel delivers PDEATHSIG and tears processes down asynchronously; allow it a
    // moment (a real orphan stays forever).
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let alive: Vec<_> = stages.iter().filter(|(p, _)| running(*p)).collect();
        if alive.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            panic!("orphan stage processes after k3-orch {orch} exited: {alive:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(dir) = memory_cgroup_dir() {
        let cg = dir.join(format!("k3-{orch}"));
        let deadline = Instant::now() + Duration::from_secs(3);
        while cg.exists() {
            assert!(
                Instant::now() < deadline,
                "cgroup {} was left behind",
                cg.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    if let Ok(rd) = std::fs::read_dir("/dev/shm") {
        let leaked: Vec<String> = rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("k3"))
            .collect();
        assert!(leaked.is_empty(), "leaked /dev/shm objects: {leaked:?}");
    }
}

fn signal(pid: u32, sig: i32) -> bool {
    // SAFETY: plain kill(2) on a pid we observed as our grandchild.
    unsafe { libc::kill(pid as i32, sig) == 0 }
}

/// One random kill: returns None when the run ended before the kill could land (the stage
/// was already gone), else (stage, exit code, seconds from kill to exit).
fn one_kill(rng: &mut impl Rng) -> Option<(String, Option<i32>, f64)> {
    // A long full-recompute generation (the later --gen wins), so the random kill lands while
    // the stages are still working even on an idle machine; the kill ends the run at once.
    let mut child = start(&["--gen", "400"], &[]);
    let orch = child.id();
    let stages = wait_stages(&mut child);
    if stages.len() != 4 {
        let (code, _, _, err) = wait_exit(child, Duration::from_secs(60));
        panic!("the four stages did not start (exit {code:?}): {err}");
    }
    std::thread::sleep(Duration::from_millis(rng.gen_range(0..2500)));
    let (pid, name) = stages[rng.gen_range(0..4)].clone();
    if !running(pid) || !signal(pid, libc::SIGKILL) {
        let _ = wait_exit(child, Duration::from_secs(120));
        assert_clean(orch, &stages);
        return None;
    }
    let (code, dt, _out, err) = wait_exit(child, Duration::from_secs(60));
    if code == Some(0) {
        // The stage had already finished its part (a clean exit raced our kill).
        assert_clean(orch, &stages);
        return None;
    }
    assert!(
        dt < Duration::from_secs(5),
        "k3-orch took {dt:?} to exit after {name} was killed"
    );
    assert!(
        err.contains(&format!("stage {name}")) && err.contains("killed by signal 9 (SIGKILL)"),
        "the error must name {name} and SIGKILL:\n{err}"
    );
    assert_clean(orch, &stages);
    Some((name, code, dt.as_secs_f64()))
}

/// The kill loop: `K3_KILLS` random kills (20 by default; scripts/kill-loop.sh runs 50).
/// A wrong supervisor that waits on the dead stage forever, or reports only a peer's
/// secondary error ("link to trunk-loader: peer died"), or leaves the others running,
/// fails here.
#[test]
fn random_sigkill_loop() {
    let n: usize = std::env::var("K3_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let seed: u64 = std::env::var("K3_KILL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    println!("kill loop: {n} kills, seed {seed} (K3_KILL_SEED to repeat)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut done = 0;
    let mut missed = 0;
    let mut worst = 0f64;
    while done < n {
        match one_kill(&mut rng) {
            Some((stage, code, dt)) => {
                done += 1;
                worst = worst.max(dt);
                println!("kill {done:2}: {stage:<15} exit {code:?} after {dt:.3} s");
            }
            None => {
                missed += 1;
                assert!(missed < n, "too many kills landed after the run ended");
            }
        }
    }
    println!("kill loop: {done} kills, all exited non-zero naming the stage; slowest {worst:.3} s; {missed} runs ended before the kill");
}

/// A stage that stops answering (SIGSTOP) is declared hung after --stage-timeout. A wrong
/// supervisor waiting on the stopped stage's link forever fails by timing out here.
#[test]
fn stopped_stage_times_out() {
    for name in ["trunk-loader", "layer-compute"] {
        let mut child = start(&["--stage-timeout", "2"], &[]);
        let orch = child.id();
        let stages = wait_stages(&mut child);
        assert_eq!(stages.len(), 4);
        std::thread::sleep(Duration::from_millis(300));
        let pid = stages.iter().find(|s| s.1 == name).unwrap().0;
        assert!(signal(pid, libc::SIGSTOP));
        let (code, dt, _, err) = wait_exit(child, Duration::from_secs(30));
        // The stopped process cannot run its own exit; make sure it is gone either way.
        signal(pid, libc::SIGKILL);
        assert!(code.is_some_and(|c| c != 0), "exit {code:?}: {err}");
        assert!(
            dt < Duration::from_secs(2 + 5),
            "took {dt:?} to notice a stopped {name}"
        );
        assert!(err.contains(name), "the error must name {name}:\n{err}");
        assert_clean(orch, &stages);
    }
}

/// Ctrl-C (SIGINT to k3-orch): the stages are shut down, k3-orch exits 130.
#[test]
fn ctrl_c_shuts_down() {
    let mut child = start(&[], &[]);
    let orch = child.id();
    let stages = wait_stages(&mut child);
    assert_eq!(stages.len(), 4);
    std::thread::sleep(Duration::from_millis(300));
    assert!(signal(orch, libc::SIGINT));
    let (code, _, _, err) = wait_exit(child, Duration::from_secs(30));
    assert!(code.is_some_and(|c| c != 0), "exit {code:?}: {err}");
    assert_eq!(code, Some(130), "{err}");
    assert_clean(orch, &stages);
}

/// Injected expert read errors: the run finishes with its full report and exits 4. A
/// wrong pipeline that aborts on the first failed expert (exit 1) or hides it (exit 0)
/// fails.
#[test]
fn injected_expert_failures_exit_4() {
    let child = start(&[], &[("K3_INJECT_EXPERT_FAILURES", "1:0,2:3")]);
    let (code, _, stdout, err) = wait_exit(child, Duration::from_secs(120));
    assert_eq!(code, Some(4), "{stdout}\n{err}");
    // The step table and the summary are diagnostics (stderr); stdout has the ids.
    let out = format!("{stdout}\n{err}");
    assert!(
        out.contains("FAILED"),
        "the report must flag the failures:\n{out}"
    );
    // One line per step: all 20 steps ran.
    assert!(
        out.lines()
            .filter(|l| l.trim_start().starts_with("19 "))
            .count()
            >= 1,
        "the report must show every step:\n{out}"
    );
}

/// A stage over its cgroup budget is OOM-killed; the run names the stage and the limit.
#[test]
fn over_budget_stage_is_oom_killed() {
    let Some(dir) = memory_cgroup_dir() else {
        println!("SKIP: no memory cgroup for this process");
        return;
    };
    let probe = dir.join(format!("k3-faults-probe-{}", std::process::id()));
    if std::fs::create_dir(&probe).is_err() {
        println!(
            "SKIP: cannot create memory cgroups under {} (not writable)",
            dir.display()
        );
        return;
    }
    let _ = std::fs::remove_dir(&probe);
    let child = start(
        &["--require-cgroups"],
        &[("K3_STAGE_BUDGET_OVERRIDE", "layer-compute=1000000")],
    );
    let orch = child.id();
    let (code, _, _, err) = wait_exit(child, Duration::from_secs(120));
    println!("OOM run: exit {code:?}\n{err}");
    assert!(code.is_some_and(|c| c != 0), "exit {code:?}: {err}");
    assert!(
        err.contains("stage layer-compute")
            && err.contains("killed by the kernel OOM killer at its memory limit"),
        "{err}"
    );
    assert_clean(orch, &[]);
}

/// `--numa stage=0,...`: each stage's memory policy (numa_maps) and affinity are node 0's.
#[test]
fn numa_placement_is_applied() {
    let node0 = match std::fs::read_to_string("/sys/devices/system/node/node0/cpulist") {
        Ok(s) => s.trim().to_string(),
        Err(_) => {
            println!("SKIP: no /sys/devices/system/node (no NUMA support)");
            return;
        }
    };
    let mut child = start(
        &["--numa", "trunk-loader=0,expert-fetcher=0,layer-compute=0"],
        &[],
    );
    let stages = wait_stages(&mut child);
    assert_eq!(stages.len(), 4);
    // Read /proc while they run; SIGSTOP keeps them in place while we look.
    let mut seen = Vec::new();
    for (pid, name) in &stages {
        if name == "tokenizer" {
            continue;
        }
        // The stage applies its placement first thing after exec; we may have found it a
        // moment earlier, so look again (briefly) until the policy shows or it is gone.
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        let (mut cpus, mut policy) = (None, false);
        while std::time::Instant::now() < deadline && running(*pid) {
            signal(*pid, libc::SIGSTOP);
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let maps =
                std::fs::read_to_string(format!("/proc/{pid}/numa_maps")).unwrap_or_default();
            signal(*pid, libc::SIGCONT);
            cpus = status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .map(|s| s.trim().to_string());
            policy = maps.contains("prefer:0") || maps.contains("bind:0");
            if policy && cpus.as_deref() == Some(node0.as_str()) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        seen.push((name.clone(), cpus, policy));
    }
    let (code, _, out, err) = wait_exit(child, Duration::from_secs(120));
    assert_eq!(code, Some(0), "{out}\n{err}");
    for (name, cpus, policy) in seen {
        assert_eq!(cpus.as_deref(), Some(node0.as_str()), "{name} affinity");
        assert!(policy, "{name}: numa_maps shows no node-0 memory policy");
    }
}
