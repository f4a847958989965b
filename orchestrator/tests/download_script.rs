//! `scripts/download-model.sh` without the network: the free-space check refuses (exit 2,
//! with the numbers) before anything is fetched; without `hf` it makes a virtual environment
//! under the target directory (never `pip install --user`) and reuses it on the next run
//! (the resume); then `hf download` and `k3-orch verify --hashes` run on the directory. The
//! tools it calls are fakes on a PATH of their own that log their arguments: `df` (the free
//! space), `python3` (makes the venv with a fake `pip` and `hf`), and `K3` (k3-orch).

use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/download-model.sh")
}

fn write_exe(p: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(p, text).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A bin directory holding the real tools the script needs, a fake `df` reporting `free`
/// bytes on one device, and a fake `python3` whose venv has a `pip` and an `hf` that log to
/// `log`.
fn fake_bin(root: &Path, free: u64, log: &Path) -> PathBuf {
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for tool in ["awk", "du", "dirname", "mkdir", "cat", "chmod"] {
        let real = ["/usr/bin", "/bin"]
            .iter()
            .map(|d| Path::new(d).join(tool))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("no {tool}"));
        std::os::unix::fs::symlink(real, bin.join(tool)).unwrap();
    }
    write_exe(
        &bin.join("df"),
        &format!(
            "#!/bin/bash\ncase \"$4\" in *other*) dev=/dev/other ;; *) dev=/dev/fake ;; esac\n\
             echo 'Filesystem 1-blocks Used Available Capacity Mounted on'\n\
             echo \"$dev 3000000000000 0 {free} 0% /\"\n"
        ),
    );
    let log = log.display();
    write_exe(
        &bin.join("python3"),
        &format!(
            "#!/bin/bash\necho \"python3 $*\" >> {log}\n\
             [[ $1 == -m && $2 == venv ]] || exit 9\nv=${{@: -1}}\nmkdir -p \"$v/bin\"\n\
             printf '#!/bin/bash\\necho \"pip $*\" >> {log}\\n' > \"$v/bin/pip\"\n\
             printf '#!/bin/bash\\necho \"hf $*\" >> {log}\\n' > \"$v/bin/hf\"\n\
             chmod +x \"$v/bin/pip\" \"$v/bin/hf\"\n"
        ),
    );
    write_exe(
        &root.join("k3"),
        &format!("#!/bin/bash\necho \"k3-orch $*\" >> {log}\n"),
    );
    bin
}

fn run(bin: &Path, root: &Path, args: &[&str]) -> (i32, String) {
    let o = Command::new("/bin/bash")
        .arg(script())
        .args(args)
        .env_clear()
        .env("PATH", bin)
        .env("K3", root.join("k3"))
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// 500 GB free where the release and its pack need 1.67 TB: refused with the numbers, and
/// nothing is installed or fetched.
#[test]
fn too_little_space_is_refused_with_the_numbers() {
    let t = tempfile::tempdir().unwrap();
    let log = t.path().join("log");
    let bin = fake_bin(t.path(), 500_000_000_000, &log);
    let dir = t.path().join("k3model");
    let (code, err) = run(&bin, t.path(), &[dir.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("REFUSING"), "{err}");
    assert!(err.contains("1.67 TB") && err.contains("500.0 GB"), "{err}");
    assert!(
        !log.exists(),
        "something ran: {:?}",
        std::fs::read_to_string(&log)
    );
    // The pack on another drive: the release alone still does not fit.
    let other = t.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let (code, err) = run(
        &bin,
        t.path(),
        &[
            "--trunk-dir",
            other.to_str().unwrap(),
            dir.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("1.56 TB"), "{err}");
    assert_eq!(run(&bin, t.path(), &[]).0, 2);
    assert_eq!(run(&bin, t.path(), &["--frob", "x"]).0, 2);
}

/// Enough space and no `hf`: a venv under DIR (python3 -m venv, pip install without
/// --user), `hf download REPO --local-dir DIR`, then `verify --hashes DIR`. A second run
/// (the resume) reuses the venv.
#[test]
fn without_hf_a_venv_under_the_target_then_download_and_verify() {
    let t = tempfile::tempdir().unwrap();
    let log = t.path().join("log");
    let bin = fake_bin(t.path(), 2_000_000_000_000, &log);
    let dir = t.path().join("k3model");
    let d = dir.to_str().unwrap();
    let (code, err) = run(&bin, t.path(), &[d]);
    assert_eq!(code, 0, "{err}");
    let calls = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = calls.lines().collect();
    assert_eq!(
        lines[0],
        format!("python3 -m venv -- {d}/.hf-venv"),
        "{calls}"
    );
    assert!(lines[1].starts_with("pip install") && lines[1].contains("huggingface_hub"));
    assert!(!calls.contains("--user"), "{calls}");
    assert_eq!(
        lines[2],
        format!("hf download moonshotai/Kimi-K3 --local-dir {d}")
    );
    assert_eq!(lines[3], format!("k3-orch verify --hashes {d}"));
    std::fs::remove_file(&log).unwrap();
    let (code, err) = run(&bin, t.path(), &[d, "someone/other-repo"]);
    assert_eq!(code, 0, "{err}");
    let calls = std::fs::read_to_string(&log).unwrap();
    assert!(!calls.contains("python3"), "the venv is made once: {calls}");
    assert!(calls.contains("hf download someone/other-repo"), "{calls}");
}
