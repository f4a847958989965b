//! Aligned arena memory (`src/arena.rs`).

use k3_io::arena::*;

#[test]
fn aligned_and_sized() {
    let a = OwnedArena::new(5000).unwrap();
    assert_eq!(a.base() as usize % ALIGN, 0);
    assert_eq!(a.len(), 8192);
    assert_eq!(align_up(0), 0);
    assert_eq!(align_up(1), 4096);
    assert_eq!(align_down(4097), 4096);
    let h = OwnedArena::new_huge(5000).unwrap();
    assert_eq!(h.base() as usize % (2 << 20), 0);
    assert_eq!(h.len(), 2 << 20);
    prefault(&h);
    prefault(&a);
}
