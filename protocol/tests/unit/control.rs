//! The control socket (`src/control.rs`): frames and fds in one process, a frame larger
//! than the socket buffer.

use std::time::Duration;

use k3_protocol::control::*;
use k3_protocol::messages::Msg;

#[test]
fn frames_and_fds_in_process() {
    let (a, b) = pair().unwrap();
    let r = k3_protocol::shm::Region::create(1, "ctl", 4096, 1).unwrap();
    r.write_at(0, b"region bytes").unwrap();
    a.send(&Msg::Ping { nonce: 5 }, &[r.fd()]).unwrap();
    a.send(&Msg::Shutdown, &[]).unwrap();
    let (m, fds) = b.recv(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(m, Msg::Ping { nonce: 5 });
    assert_eq!(fds.len(), 1);
    let (m2, fds2) = b.recv(Some(Duration::from_secs(5))).unwrap();
    assert_eq!((m2, fds2.len()), (Msg::Shutdown, 0));
    let mut t = k3_protocol::shm::RegionTable::new();
    let id = t
        .insert_fd(
            fds.into_iter().next().unwrap(),
            k3_protocol::shm::Access::ReadOnly,
        )
        .unwrap();
    let h = r.handle(0, 0, 12).unwrap();
    assert_eq!(id, 1);
    // SAFETY: nothing writes the region while we read.
    assert_eq!(unsafe { t.resolve(&h) }.unwrap(), b"region bytes");
    assert!(matches!(
        b.recv_frame(Some(Duration::from_millis(10))),
        Err(ControlError::Timeout)
    ));
    drop(a);
    assert!(matches!(b.recv_frame(None), Err(ControlError::Closed)));
}

#[test]
fn big_frame_crosses_socket_buffer() {
    let (a, b) = pair().unwrap();
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7) as u8).collect();
    let big2 = big.clone();
    let t = std::thread::spawn(move || a.send_frame(&big2, &[]).unwrap());
    let (got, fds) = b.recv_frame(Some(Duration::from_secs(30))).unwrap();
    t.join().unwrap();
    assert!(fds.is_empty());
    assert_eq!(got, big);
}
