//! Aligned memory that reads land in: the loaders' arenas and scratch buffers.
//!
//! The loaders only need "a 4096-aligned run of bytes that lives as long as I do", so that
//! is what [`ArenaMemory`] is. [`OwnedArena`] is a private heap allocation (tests, tools,
//! scratch); the stages back the same trait with a shared-memory region
//! (`k3_protocol::shm::ShmArena`), so the `(offset, len)` pairs they publish become
//! handles that layer-compute maps in place. [`ALIGN`] is the one alignment constant of
//! the workspace (O_DIRECT needs 4096: pages and sectors).

use std::alloc::Layout;
use std::ptr::NonNull;

/// Alignment of the arena base and of every slot: O_DIRECT needs 4096 (pages, sectors).
pub const ALIGN: usize = 4096;

/// Round `n` up to a multiple of [`ALIGN`].
pub const fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN as u64) * ALIGN as u64
}

/// Bytes one arena slot needs for reads of at most `max_span` bytes at any file offset (the
/// span rounded up, plus one page for a start that is not page-aligned).
pub fn slot_bytes_for(max_span: u64) -> u64 {
    align_up(max_span) + ALIGN as u64
}

/// Round `n` down to a multiple of [`ALIGN`].
pub const fn align_down(n: u64) -> u64 {
    n / ALIGN as u64 * ALIGN as u64
}

/// A run of memory the fetcher may write through raw pointers from several threads (each
/// thread a disjoint slot).
///
/// # Safety
/// Implementors guarantee that `base()` is non-null, aligned to [`ALIGN`], valid for reads
/// and writes of `len()` bytes for as long as the value lives, and not accessed by anyone
/// else while the fetcher owns it.
pub unsafe trait ArenaMemory: Send + Sync {
    /// First byte.
    fn base(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True when the arena has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An arena that could not be allocated.
#[derive(Debug, thiserror::Error)]
#[error("cannot allocate a {bytes}-byte expert arena: {why}")]
pub struct ArenaError {
    pub bytes: usize,
    pub why: String,
}

/// A 4096-aligned heap allocation, zeroed lazily by the allocator (pages are not touched
/// until a read lands in them).
pub struct OwnedArena {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the allocation is plain bytes owned by this value; concurrent access is coordinated
// by the fetcher (disjoint slots), as the `ArenaMemory` contract requires.
unsafe impl Send for OwnedArena {}
// SAFETY: as above; `&OwnedArena` only hands out the base pointer.
unsafe impl Sync for OwnedArena {}

impl OwnedArena {
    /// Allocate `bytes` (rounded up to [`ALIGN`], at least one page).
    pub fn new(bytes: usize) -> Result<OwnedArena, ArenaError> {
        Self::with_align(bytes, ALIGN)
    }

    /// Allocate on 2 MiB boundaries and ask the kernel for transparent huge pages
    /// (`madvise(MADV_HUGEPAGE)`; a hint, ignored where THP is off). O_DIRECT pins its target
    /// pages on every read, and a 17.5 MB slot is 4,284 small pages but 9 huge ones.
    pub fn new_huge(bytes: usize) -> Result<OwnedArena, ArenaError> {
        const HUGE: usize = 2 << 20;
        let size = (bytes.max(1)).div_ceil(HUGE) * HUGE;
        let a = Self::with_align(size, HUGE)?;
        // SAFETY: the range is exactly our allocation; MADV_HUGEPAGE changes no contents.
        unsafe {
            libc::madvise(a.base() as *mut libc::c_void, a.len(), libc::MADV_HUGEPAGE);
        }
        Ok(a)
    }

    fn with_align(bytes: usize, align: usize) -> Result<OwnedArena, ArenaError> {
        let size = (align_up(bytes as u64).max(ALIGN as u64)) as usize;
        let layout = Layout::from_size_align(size, align).map_err(|e| ArenaError {
            bytes,
            why: e.to_string(),
        })?;
        // SAFETY: `layout` has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| ArenaError {
            bytes,
            why: "out of memory".into(),
        })?;
        Ok(OwnedArena { ptr, layout })
    }
}

impl OwnedArena {
    /// The bytes, mutably (an owned arena has one owner: `&mut self` is exclusive access).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the allocation is valid for `layout.size()` zero-initialised bytes while
        // `self` lives, and `&mut self` guarantees no other access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

/// Touch every page of an arena once (write into each), so its memory is faulted in
/// now, by the calling process: the stage that owns a region pays for it in its cgroup, and
/// the first token does not pay the page faults.
pub fn prefault(arena: &dyn ArenaMemory) {
    // SAFETY: base() is valid for len() bytes (the trait's contract); callers prefault
    // before any slot is in use, so nothing else reads or writes it meanwhile.
    unsafe { touch_raw(arena.base(), arena.len()) };
}

/// Write one byte of every [`ALIGN`]-byte stretch of `s` back to itself, so its pages are
/// faulted in now, on the calling thread (a zeroed allocation is mapped lazily); no value
/// changes. The same touch as [`prefault`], for compute state that a pool's threads would
/// otherwise fault in side by side on its first use.
pub fn touch_f32_pages(s: &mut [f32]) {
    // SAFETY: the slice is valid and exclusively borrowed for its whole byte length, every
    // byte of an f32 is initialised, and rewriting a byte with its own value changes none.
    unsafe { touch_raw(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) };
}

/// # Safety
/// `base` must be valid for reads and writes of `len` bytes, with no other access meanwhile.
unsafe fn touch_raw(base: *mut u8, len: usize) {
    for off in (0..len).step_by(ALIGN) {
        // SAFETY: `off < len` (caller's range); volatile, so the touch is not optimised away.
        unsafe {
            let p = base.add(off);
            std::ptr::write_volatile(p, std::ptr::read_volatile(p));
        }
    }
}

impl Drop for OwnedArena {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: the pointer comes from a live allocation of `layout.size()` bytes aligned to ALIGN.
unsafe impl ArenaMemory for OwnedArena {
    fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.layout.size()
    }
}
