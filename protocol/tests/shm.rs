//! Shared regions across a real process boundary: a child process (this test binary
//! re-executed) owns a region, first-touches and fills it, and hands its memfd over the
//! control socket (SCM_RIGHTS) with handles inside messages; the parent maps it read-only and
//! resolves the handles, with bounds and generation checks.

use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::time::Duration;

use k3_protocol::control::{self, ChildOptions, ControlSocket};
use k3_protocol::messages::{Msg, RegionRole};
use k3_protocol::shm::{Access, Handle, HandleError, Region, RegionTable, ShmError};

const OWNER_ENV: &str = "K3_TEST_SHM_OWNER";
const T: Option<Duration> = Some(Duration::from_secs(20));
const SLOT: u64 = 8192;

fn pattern(slot: u32, generation: u64) -> Vec<u8> {
    (0..SLOT as usize)
        .map(|i| (i as u64 * 13 + slot as u64 * 101 + generation * 7) as u8)
        .collect()
}

fn handle_of(m: Msg) -> Handle {
    match m {
        Msg::ExpertReady { handle, .. } => handle,
        m => panic!("expected ExpertReady, got {m:?}"),
    }
}

/// The region owner, run in the child process (the parent runs it by its exact name with
/// `--ignored`; in a normal run it is ignored, so it is never counted as a pass).
#[test]
#[ignore = "child-process entry point: the parent test runs it with --ignored --exact"]
fn region_owner_main() {
    if std::env::var(OWNER_ENV).is_err() {
        return;
    }
    let ctl = ControlSocket::from_env().unwrap();
    let r = Region::create(40, "arena", SLOT, 4).unwrap();
    r.prefault().unwrap();
    for s in 0..4 {
        r.write_at(s as u64 * SLOT, &pattern(s, 1)).unwrap();
    }
    ctl.send(
        &Msg::Region {
            id: 40,
            role: RegionRole::Data {
                name: "arena".into(),
            },
        },
        &[r.fd()],
    )
    .unwrap();
    let h = r.handle(2, 0, SLOT).unwrap();
    ctl.send(
        &Msg::ExpertReady {
            pass: 0,
            layer: 0,
            id: 2,
            handle: h,
        },
        &[],
    )
    .unwrap();
    // Wait for "done with slot 2", then reuse it: bump first, then rewrite, then publish.
    let (m, _) = ctl.recv(T).unwrap();
    assert!(matches!(m, Msg::ExpertsDone { .. }), "{m:?}");
    let g = r.bump_generation(2).unwrap();
    r.write_at(2 * SLOT, &pattern(2, g)).unwrap();
    let h2 = r.handle(2, 0, SLOT).unwrap();
    ctl.send(
        &Msg::ExpertReady {
            pass: 0,
            layer: 1,
            id: 2,
            handle: h2,
        },
        &[],
    )
    .unwrap();
    let (m, _) = ctl.recv(T).unwrap();
    assert_eq!(m, Msg::Shutdown);
}

/// Catches: a reader that trusts handles blindly (no bounds check, no slot check, no
/// generation check), and an fd hand-off that maps the wrong file or the wrong offset.
#[test]
fn handles_resolve_across_processes_with_bounds_and_generation() {
    if std::env::var(OWNER_ENV).is_ok() {
        return;
    }
    let (ours, theirs) = control::pair().unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--ignored",
        "--exact",
        "shm::region_owner_main",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(OWNER_ENV, "1")
    .stdin(Stdio::null())
    .stdout(Stdio::null());
    control::prepare_child(
        &mut cmd,
        &theirs,
        ChildOptions {
            kill_on_parent_death: true,
        },
    );
    let mut child = cmd.spawn().unwrap();
    drop(theirs);

    let (m, mut fds) = ours.recv(T).unwrap();
    assert!(matches!(m, Msg::Region { id: 40, .. }), "{m:?}");
    assert_eq!(fds.len(), 1);
    let mut table = RegionTable::new();
    assert_eq!(
        table
            .insert_fd(fds.pop().unwrap(), Access::ReadOnly)
            .unwrap(),
        40
    );
    let h = handle_of(ours.recv(T).unwrap().0);
    assert_eq!(
        (h.region, h.offset, h.len, h.generation),
        (40, 2 * SLOT, SLOT, 1)
    );
    // SAFETY: the owner does not touch slot 2 until we send ExpertsDone below.
    let bytes = unsafe { table.resolve(&h) }.unwrap();
    assert_eq!(bytes, &pattern(2, 1)[..]);
    let sub = Handle {
        offset: h.offset + 100,
        len: 50,
        ..h
    };
    // SAFETY: as above.
    assert_eq!(
        unsafe { table.resolve(&sub) }.unwrap(),
        &pattern(2, 1)[100..150]
    );

    // Bounds: past the end, overflowing, crossing into the next slot, unknown region.
    let past = Handle {
        offset: 4 * SLOT - 10,
        len: 11,
        ..h
    };
    assert!(matches!(
        table.check(&past),
        Err(HandleError::OutOfBounds { .. })
    ));
    let wrap = Handle {
        offset: u64::MAX - 3,
        len: 8,
        ..h
    };
    assert!(matches!(
        table.check(&wrap),
        Err(HandleError::OutOfBounds { .. })
    ));
    let cross = Handle {
        offset: 2 * SLOT + 10,
        len: SLOT,
        ..h
    };
    assert!(matches!(
        table.check(&cross),
        Err(HandleError::CrossesSlot { slot: 2, .. })
    ));
    let other = Handle { region: 41, ..h };
    assert_eq!(table.check(&other), Err(HandleError::UnknownRegion(41)));
    // The read-only mapping refuses writes.
    assert!(matches!(
        table.get(40).unwrap().write_at(0, b"x"),
        Err(ShmError::ReadOnly(40))
    ));

    ours.send(
        &Msg::ExpertsDone {
            pass: 0,
            layer: 0,
            ids: vec![2],
        },
        &[],
    )
    .unwrap();
    let h2 = handle_of(ours.recv(T).unwrap().0);
    assert_eq!(h2.generation, 2);
    assert_eq!(
        table.check(&h),
        Err(HandleError::StaleGeneration {
            region: 40,
            slot: 2,
            handle: 1,
            current: 2
        })
    );
    // SAFETY: the owner does not touch slot 2 again.
    assert_eq!(unsafe { table.resolve(&h2) }.unwrap(), &pattern(2, 2)[..]);
    // Other slots keep their generation.
    let h0 = Handle {
        offset: 0,
        len: 16,
        generation: 1,
        ..h
    };
    // SAFETY: slot 0 is never rewritten.
    assert_eq!(unsafe { table.resolve(&h0) }.unwrap(), &pattern(0, 1)[..16]);

    ours.send(&Msg::Shutdown, &[]).unwrap();
    assert!(child.wait().unwrap().success());
    // The owner is gone; our mapping still holds the bytes (the memfd lives while mapped).
    // SAFETY: nobody can write it any more.
    assert_eq!(unsafe { table.resolve(&h2) }.unwrap(), &pattern(2, 2)[..]);
}

/// Catches: `Region::open` that maps any fd it is given (an unsealed memfd can be shrunk
/// under the reader, turning reads into SIGBUS), or trusts a header that disagrees with the
/// file size.
#[test]
fn open_refuses_unsealed_and_inconsistent_files() {
    if std::env::var(OWNER_ENV).is_ok() {
        return;
    }
    let fd = rustix::fs::memfd_create("k3-test-unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, 8192).unwrap();
    assert!(matches!(
        Region::open(fd, Access::ReadOnly),
        Err(ShmError::BadHeader(_))
    ));

    // A sealed file whose header claims more data than the file holds.
    let fd = rustix::fs::memfd_create(
        "k3-test-liar",
        rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
    )
    .unwrap();
    rustix::fs::ftruncate(&fd, 8192).unwrap();
    let mut hdr = Vec::new();
    hdr.extend_from_slice(b"K3SHMRG1");
    hdr.extend_from_slice(&9u32.to_le_bytes()); // id
    hdr.extend_from_slice(&1u32.to_le_bytes()); // slots
    hdr.extend_from_slice(&4096u64.to_le_bytes()); // header length
    hdr.extend_from_slice(&(1u64 << 30).to_le_bytes()); // data length: a lie
    hdr.extend_from_slice(&(1u64 << 30).to_le_bytes()); // slot size
    rustix::io::pwrite(&fd, &hdr, 0).unwrap();
    rustix::fs::fcntl_add_seals(
        &fd,
        rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW,
    )
    .unwrap();
    assert!(matches!(
        Region::open(fd.as_fd().try_clone_to_owned().unwrap(), Access::ReadOnly),
        Err(ShmError::BadHeader(_))
    ));
}
