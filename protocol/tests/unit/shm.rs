//! Shared regions (`src/shm.rs`): create, open, resolve, and the slots' generations.

use k3_protocol::shm::*;

#[test]
fn create_open_resolve_and_generation() {
    let r = Region::create(7, "t", 4096, 3).unwrap();
    r.prefault().unwrap();
    r.write_at(4096 + 10, b"hello").unwrap();
    let h = r.handle(1, 10, 5).unwrap();
    assert_eq!(h.offset, 4106);
    let mut t = RegionTable::new();
    t.insert_fd(r.try_clone_fd().unwrap(), Access::ReadOnly)
        .unwrap();
    // SAFETY: nobody writes the region during the test's borrow.
    assert_eq!(unsafe { t.resolve(&h) }.unwrap(), b"hello");
    // A bump of another slot leaves this handle valid; of its own slot, makes it stale.
    r.bump_generation(0).unwrap();
    t.check(&h).unwrap();
    assert_eq!(r.bump_generation(1).unwrap(), 2);
    assert!(matches!(
        t.check(&h),
        Err(HandleError::StaleGeneration {
            slot: 1,
            handle: 1,
            current: 2,
            ..
        })
    ));
    // Read-only mapping cannot be written.
    let ro = t.get(7).unwrap();
    assert!(matches!(ro.write_at(0, b"x"), Err(ShmError::ReadOnly(7))));
    assert!(matches!(ro.bump_generation(0), Err(ShmError::ReadOnly(7))));
}
