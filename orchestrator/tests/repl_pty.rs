//! `k3-orch chat` as a user at a terminal drives it: the REPL on a pseudo-terminal (the
//! child is a session leader with the pty as its controlling terminal, so a `^C` typed into
//! it is the terminal's SIGINT to its foreground process group, the stages included), on
//! the tiny chat model. Also, from a pipe: a line that is not UTF-8, `/save` and `/load`
//! of files that are not regular, and SIGTERM/SIGINT cleaning up the stages' cgroups
//! (issue 34 "The REPL", issue 36 "second hostile probe" item 11).

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::serve_http::{k3_cgroup_of, wait_for_stages};
use crate::tools_common::{bin, skip, tiny_chat_model as model};

/// `k3-orch chat` on a pty: what it wrote so far (stdout and stderr, as the terminal shows
/// them), and the master side to type into.
struct Pty {
    child: Child,
    master: std::fs::File,
    out: Arc<Mutex<Vec<u8>>>,
    /// How much of `out` the expectations have consumed.
    seen: usize,
}

impl Drop for Pty {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Pty {
    /// Start `k3-orch chat MODEL --tok MODEL --threads 1 EXTRA...` on a new pty.
    fn chat(extra: &[&str]) -> Pty {
        let (mut m, mut s) = (-1, -1);
        // SAFETY: openpty writes the two descriptors through the pointers; the name,
        // termios and window-size arguments may be null (defaults: canonical mode, echo,
        // signals from ^C).
        let rc = unsafe {
            libc::openpty(
                &mut m,
                &mut s,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: openpty returned two fresh descriptors that nothing else owns.
        let (master, slave) = unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
        let md = model().to_str().unwrap();
        let mut cmd = Command::new(bin());
        cmd.args(["chat", md, "--tok", md, "--threads", "1"])
            .args(extra)
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave));
        // SAFETY: between fork and exec only async-signal-safe calls: setsid and ioctl.
        // Stdin is the pty's slave by then; it becomes the controlling terminal.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        drop(cmd); // the parent's copies of the slave
        let master = std::fs::File::from(master);
        let out = Arc::new(Mutex::new(Vec::new()));
        let (mut r, o) = (master.try_clone().unwrap(), out.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // EIO once the child (the last holder of the slave) is gone.
            while let Ok(n) = r.read(&mut buf) {
                if n == 0 {
                    break;
                }
                o.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Pty {
            child,
            master,
            out,
            seen: 0,
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().unwrap()).into_owned()
    }

    /// Wait (at most `secs`) for `what` past what was already consumed; consume up to its
    /// end and return the text from the old position to there.
    fn expect(&mut self, what: &str, secs: u64) -> String {
        let t0 = Instant::now();
        loop {
            let all = self.out.lock().unwrap().clone();
            let tail = &all[self.seen.min(all.len())..];
            if let Some(i) = find(tail, what.as_bytes()) {
                let got = String::from_utf8_lossy(&tail[..i + what.len()]).into_owned();
                self.seen += i + what.len();
                return got;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "no {what:?} within {secs} s; the terminal shows (the end):\n{}",
                last(&String::from_utf8_lossy(&all))
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.master.write_all(bytes).unwrap();
        self.master.flush().unwrap();
    }

    /// Wait for the exit (at most `secs`); its code.
    fn exit_code(&mut self, secs: u64) -> Option<i32> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "chat still running {secs} s later; the terminal shows (the end):\n{}",
                last(&self.text())
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The last 3,000 characters of `s` (a reply of random tokens can be long).
fn last(s: &str) -> String {
    let n = s.chars().count();
    s.chars().skip(n.saturating_sub(3000)).collect()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The stages' cgroups (empty without per-stage cgroups: not root).
fn cgroups_of(stages: &[(String, u32)]) -> Vec<PathBuf> {
    stages
        .iter()
        .filter_map(|(_, p)| k3_cgroup_of(*p))
        .collect()
}

/// Nothing of the session is left: no stage process, no cgroup.
fn assert_cleaned_up(stages: &[(String, u32)], cgroups: &[PathBuf], what: &str) {
    std::thread::sleep(Duration::from_millis(100));
    for (name, p) in stages {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
        assert!(
            stat.is_empty() || stat.contains(") Z "),
            "{what}: stage {name} (pid {p}) outlived chat"
        );
    }
    for d in cgroups {
        assert!(!d.exists(), "{what}: cgroup {} outlived chat", d.display());
    }
}

/// Ctrl-C during a reply stops the reply, not the session: the same stages serve the next
/// turn (its prompt reuses the first turn's state), `/stats` reports the last reply, and
/// two Ctrl-Cs at an empty prompt end the session, leaving no stage or cgroup behind.
/// Catches: the default SIGINT (exit 130, the trunk loaded again), stages killed by the
/// terminal's ^C, a `/stats` that is not there.
#[test]
fn ctrl_c_stops_the_reply_and_keeps_the_session() {
    let mut t = Pty::chat(&["-n", "2000"]);
    t.expect("/exit", 60);
    t.expect("> ", 10);
    let stages = wait_for_stages(t.child.id());
    let cgroups = cgroups_of(&stages);
    t.send(b"/stats\n");
    t.expect("(no reply yet)", 10);
    t.send(b"Hello there\n");
    t.expect("Hello there", 10);
    // Let the reply run a little, then ^C.
    let start = t.out.lock().unwrap().len();
    let t0 = Instant::now();
    while t.out.lock().unwrap().len() < start + 40 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{}",
            last(&t.text())
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    t.send(b"\x03");
    let stopped = t.expect("(stopped after ", 10);
    let _ = stopped;
    let n: usize = t
        .expect(" tokens", 5)
        .trim_end_matches(" tokens")
        .parse()
        .unwrap_or_else(|_| panic!("{}", t.text()));
    assert!((1..2000).contains(&n), "stopped after {n} tokens");
    t.expect("> ", 10);
    assert_eq!(t.child.try_wait().unwrap(), None, "{}", last(&t.text()));
    t.send(b"/stats\n");
    let line = t.expect("finish cancelled)", 10);
    assert!(
        line.contains(&format!("(last reply: {n} tokens, ")) && line.contains(" tokens/s"),
        "{line}"
    );
    assert!(
        line.contains("prefill ") && line.contains(", 0 of them cached"),
        "{line}"
    );
    // The next turn runs on the same stages and reuses the first turn's state.
    t.send(b"And then?\n");
    t.expect("And then?", 10);
    let start = t.out.lock().unwrap().len();
    let t0 = Instant::now();
    while t.out.lock().unwrap().len() < start + 20 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{}",
            last(&t.text())
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    t.send(b"\x03");
    t.expect("(stopped after ", 10);
    t.expect("> ", 10);
    t.send(b"/stats\n");
    let line = t.expect("finish cancelled)", 10);
    let cached: usize = line
        .split(" prompt tokens, ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(cached > 0, "the second turn reused the first: {line}");
    let mut now: Vec<u32> = wait_for_stages(t.child.id()).iter().map(|s| s.1).collect();
    let mut before: Vec<u32> = stages.iter().map(|s| s.1).collect();
    now.sort_unstable();
    before.sort_unstable();
    assert_eq!(now, before, "the stages were started again");
    // ^C at an empty prompt warns; a second one ends the session.
    t.expect("> ", 10);
    t.send(b"\x03");
    t.expect("Ctrl-C again to exit", 10);
    t.send(b"\x03");
    assert_eq!(t.exit_code(10), Some(0), "{}", last(&t.text()));
    assert_cleaned_up(&stages, &cgroups, "two Ctrl-Cs");
    if cgroups.is_empty() {
        skip(
            "ctrl_c_stops_the_reply_and_keeps_the_session (its cgroup check)",
            "the stages run without per-stage cgroups (needs root)",
        );
    }
}

/// A `"""` block and a line ending in `\` are one turn each, their lines joined with
/// newlines (the saved conversation shows what was sent). Catches: each pasted line
/// becoming a turn of its own.
#[test]
fn multi_line_input_is_one_turn() {
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("conv.json");
    let mut t = Pty::chat(&["-n", "3"]);
    t.expect("> ", 60);
    t.send(b"\"\"\"\nfirst line\n\nsecond line\n\"\"\"\n");
    t.expect("> ", 30);
    t.send(b"one\\\ntwo\\\nthree\n");
    t.expect("> ", 30);
    t.send(format!("/save {}\n", saved.display()).as_bytes());
    t.expect("(saved 4 messages", 30);
    t.send(b"/exit\n");
    assert_eq!(t.exit_code(10), Some(0), "{}", last(&t.text()));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&saved).unwrap()).unwrap();
    let m = v["messages"].as_array().unwrap();
    let roles: Vec<&str> = m.iter().map(|x| x["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"], "{v}");
    assert_eq!(m[0]["content"], "first line\n\nsecond line", "{v}");
    assert_eq!(m[2]["content"], "one\ntwo\nthree", "{v}");
}

/// `k3-orch chat` from a pipe with `input`, stdin then closed; (exit code, stdout, stderr).
fn chat_pipe(input: &[u8]) -> (Option<i32>, String, String) {
    let m = model().to_str().unwrap();
    let mut child = Command::new(bin())
        .args(["chat", m, "--tok", m, "-n", "3", "--threads", "1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    // A session that hangs (a FIFO opened for writing waits for a reader) fails the test
    // after 60 s instead of holding the test run.
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if rx.recv_timeout(Duration::from_secs(60)).is_err() {
            // SAFETY: kill(2) on our own child's pid. Only wait_with_output reaps it, and
            // the watchdog is told to stand down right after: the pid could be reused only
            // by a child that ends at the 60 s mark exactly.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let o = child.wait_with_output().unwrap();
    let _ = tx.send(());
    let _ = watchdog.join();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_ne!(
        o.status.code(),
        None,
        "chat hung (killed after 60 s): {err}"
    );
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        err,
    )
}

/// A line that is not UTF-8 is refused with a message and the session goes on. Catches:
/// the session ending with exit 1 ("stream did not contain valid UTF-8").
#[test]
fn a_line_that_is_not_utf8_is_refused_and_the_session_goes_on() {
    let (code, out, err) = chat_pipe(b"caf\xe9 \xff\xfe\nHello\n/exit\n");
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("not valid UTF-8"), "{err}");
    assert_eq!(out.lines().count(), 1, "one reply, to Hello: {out:?}");
}

/// `/save` to a device, a FIFO or a directory is refused before anything is written (no
/// `/dev/null.state`, no `FIFO.state`, no hang), and `/load` of `/dev/zero` or a FIFO is
/// refused rather than read. Catches: `/save /dev/null` writing `/dev/null.state`, a FIFO
/// blocking the session, `/load /dev/zero` reading until memory runs out.
#[test]
fn save_and_load_refuse_files_that_are_not_regular() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("f");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let sub = dir.path().join("d");
    std::fs::create_dir(&sub).unwrap();
    let devnull_state = Path::new("/dev/null.state");
    assert!(!devnull_state.exists(), "left over from elsewhere");
    let input = format!(
        "Hello\n/save /dev/null\n/save {f}\n/save {d}\n/load /dev/zero\n/load {f}\n/exit\n",
        f = fifo.display(),
        d = sub.display()
    );
    let (code, _, err) = chat_pipe(input.as_bytes());
    let planted = devnull_state.exists();
    if planted {
        let _ = std::fs::remove_file(devnull_state);
    }
    assert!(!planted, "/save /dev/null wrote /dev/null.state: {err}");
    assert_eq!(code, Some(0), "{err}");
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_char_device());
    assert!(!dir.path().join("f.state").exists(), "{err}");
    assert!(!dir.path().join("d.state").exists(), "{err}");
    assert!(
        std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo(),
        "the FIFO was replaced"
    );
    for what in [
        "cannot save /dev/null: /dev/null is not a regular file".to_string(),
        format!(
            "cannot save {}: {} is not a regular file",
            fifo.display(),
            fifo.display()
        ),
        format!(
            "cannot save {}: {} is not a regular file",
            sub.display(),
            sub.display()
        ),
        "cannot load /dev/zero: not a regular file".to_string(),
        format!("cannot load {}: not a regular file", fifo.display()),
    ] {
        assert!(err.contains(&what), "no {what:?} in {err}");
    }
}

/// SIGTERM, and SIGINT from a pipe, end the session at once and leave no stage process or
/// cgroup behind. Catches: the default handlers (the stages' cgroups stayed until the next
/// run).
#[test]
fn sigterm_and_sigint_leave_no_stages_or_cgroups() {
    let m = model().to_str().unwrap();
    let mut had_cgroups = true;
    for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        let mut child = Command::new(bin())
            .args(["chat", m, "--tok", m, "-n", "3", "--threads", "1"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"Hello\n").unwrap();
        let stages = wait_for_stages(child.id());
        let cgroups = cgroups_of(&stages);
        had_cgroups &= !cgroups.is_empty();
        // The reply is out: the session waits at its prompt.
        let mut reply = String::new();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        std::io::BufRead::read_line(&mut out, &mut reply).unwrap();
        let t0 = Instant::now();
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(6),
                "{name}: still running"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert_eq!(status.code(), Some(0), "{name}: {err}");
        assert_cleaned_up(&stages, &cgroups, name);
        drop(stdin);
    }
    if !had_cgroups {
        skip(
            "sigterm_and_sigint_leave_no_stages_or_cgroups (its cgroup check)",
            "the stages run without per-stage cgroups (needs root)",
        );
    }
}
