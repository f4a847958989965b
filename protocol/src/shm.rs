//! Shared-memory regions and the handles that point into them.
//!
//! A [`Region`] is an anonymous memfd (`MFD_CLOEXEC`, sealed against shrinking and growing so a
//! reader's mapping can never be cut short under it) sized with `ftruncate` and mapped with
//! memmap2. Its first page is a self-describing header: magic, region id, data size, the slot
//! geometry and one *generation* word per slot. The data area starts on the next page.
//!
//! The stage that creates a region owns it: it first-touches it ([`Region::prefault`]) so that
//! its own memory cgroup pays for the pages, writes into it, and publishes [`Handle`]s
//! `{region, offset, len, generation}`. Readers receive the memfd over the control socket
//! (SCM_RIGHTS), map it read-only in a [`RegionTable`] and resolve handles to byte slices in
//! their own mapping after checking bounds and generation. When the owner reuses a slot it
//! bumps that slot's generation first ([`Region::bump_generation`]), so a stale handle is
//! refused instead of silently reading the new contents.
//!
//! Nothing here has a name in the file system: when the last fd and mapping go away (including
//! when a process is SIGKILLed) the kernel frees the memory, so no shared-memory object leaks.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

/// Magic at the start of every region header.
pub const REGION_MAGIC: u64 = u64::from_le_bytes(*b"K3SHMRG1");
/// Size of a page as far as the header layout is concerned (data starts page aligned).
pub const PAGE: usize = 4096;
/// Offset of the generation table inside the header.
const GEN_TABLE_OFFSET: usize = 64;
/// Upper bound on slots per region (keeps the header small and bounded when read back).
pub const MAX_SLOTS: u32 = 1 << 20;

/// A reference to bytes inside a region. Plain data: it travels inside messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Handle {
    /// Region id (unique within one pipeline run; chosen by the region's creator).
    pub region: u32,
    /// Byte offset from the start of the region's data area.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Generation of the slot that holds `offset` when the handle was made.
    pub generation: u64,
}

/// Why a handle did not resolve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    #[error("handle names region {0}, which this process has not mapped")]
    UnknownRegion(u32),
    #[error("handle for region {region} is out of bounds: offset {offset} + len {len} > data size {size}")]
    OutOfBounds {
        region: u32,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("handle for region {region} (offset {offset}, len {len}) crosses the end of slot {slot} (slot size {slot_size})")]
    CrossesSlot {
        region: u32,
        offset: u64,
        len: u64,
        slot: u64,
        slot_size: u64,
    },
    #[error("stale handle for region {region} slot {slot}: generation {handle} but the slot is now at {current}")]
    StaleGeneration {
        region: u32,
        slot: u64,
        handle: u64,
        current: u64,
    },
}

/// Errors creating, opening or writing a region.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("shared memory: {op} failed: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("shared memory region header is invalid: {0}")]
    BadHeader(String),
    #[error("shared memory region geometry is invalid: {0}")]
    BadGeometry(String),
    #[error("shared memory region {0} is mapped read-only here")]
    ReadOnly(u32),
    #[error("region id {0} is already in the table")]
    DuplicateId(u32),
    #[error(transparent)]
    Handle(#[from] HandleError),
}

fn io_err(op: &'static str) -> impl FnOnce(rustix::io::Errno) -> ShmError {
    move |e| ShmError::Io {
        op,
        source: e.into(),
    }
}

/// How this process maps a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Data readers: weights, expert bytes. Writes through this mapping are impossible.
    ReadOnly,
    /// Owners, and both ends of a ring region (head/tail/doorbell words are written by both).
    ReadWrite,
}

/// One memfd-backed shared-memory region (see the module docs for the layout).
pub struct Region {
    id: u32,
    fd: OwnedFd,
    map: MmapRaw,
    data_offset: usize,
    data_len: usize,
    slot_size: usize,
    nslots: u32,
    access: Access,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id)
            .field("data_len", &self.data_len)
            .field("slot_size", &self.slot_size)
            .field("nslots", &self.nslots)
            .field("access", &self.access)
            .finish()
    }
}

fn header_len(nslots: u32) -> usize {
    (GEN_TABLE_OFFSET + 8 * nslots as usize).div_ceil(PAGE) * PAGE
}

impl Region {
    /// Create a region of `nslots` slots of `slot_size` bytes each (data size
    /// `slot_size * nslots`), every slot at generation 1. `name` only shows up in
    /// `/proc/<pid>/fd` (as `memfd:<name>`), which helps debugging.
    ///
    /// The pages are not touched here: call [`Region::prefault`] from the owning process.
    pub fn create(id: u32, name: &str, slot_size: u64, nslots: u32) -> Result<Region, ShmError> {
        if nslots == 0 || nslots > MAX_SLOTS {
            return Err(ShmError::BadGeometry(format!(
                "{nslots} slots (must be 1..={MAX_SLOTS})"
            )));
        }
        if slot_size == 0 {
            return Err(ShmError::BadGeometry("slot size 0".into()));
        }
        let data_len = slot_size
            .checked_mul(nslots as u64)
            .filter(|&n| n <= isize::MAX as u64 / 2)
            .ok_or_else(|| {
                ShmError::BadGeometry(format!("{nslots} slots x {slot_size} bytes overflows"))
            })?;
        let hdr = header_len(nslots);
        let total = hdr as u64 + data_len;
        let fd = rustix::fs::memfd_create(
            format!("k3-{name}"),
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(io_err("memfd_create"))?;
        rustix::fs::ftruncate(&fd, total).map_err(io_err("ftruncate"))?;
        // Sealing is what lets a reader trust that the file never shrinks under its mapping
        // (a shrink would turn reads into SIGBUS).
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(io_err("fcntl(F_ADD_SEALS)"))?;
        let map = MmapOptions::new()
            .len(total as usize)
            .map_raw(&fd)
            .map_err(|source| ShmError::Io { op: "mmap", source })?;
        let base = map.as_mut_ptr();
        // SAFETY: the mapping is `total >= hdr >= 64 + 8*nslots` bytes long, page aligned, and
        // nobody else has the fd yet, so these plain writes cannot race. Atomics for the
        // generation words are created over 8-aligned, in-bounds, zero-initialised memory.
        unsafe {
            (base as *mut u64).write(REGION_MAGIC);
            (base.add(8) as *mut u32).write(id);
            (base.add(12) as *mut u32).write(nslots);
            (base.add(16) as *mut u64).write(hdr as u64);
            (base.add(24) as *mut u64).write(data_len);
            (base.add(32) as *mut u64).write(slot_size);
            for s in 0..nslots as usize {
                (*(base.add(GEN_TABLE_OFFSET + 8 * s) as *const AtomicU64))
                    .store(1, Ordering::Release);
            }
        }
        Ok(Region {
            id,
            fd,
            map,
            data_offset: hdr,
            data_len: data_len as usize,
            slot_size: slot_size as usize,
            nslots,
            access: Access::ReadWrite,
        })
    }

    /// Map a region received as an fd, validating its header against the file size and its
    /// seals. Every number read from the header is checked before use.
    pub fn open(fd: OwnedFd, access: Access) -> Result<Region, ShmError> {
        let st = rustix::fs::fstat(&fd).map_err(io_err("fstat"))?;
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(io_err("fcntl(F_GET_SEALS)"))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(ShmError::BadHeader(
                "the memfd is not sealed against shrinking (a reader could be SIGBUSed)".into(),
            ));
        }
        let file_len = st.st_size as u64;
        if file_len < PAGE as u64 {
            return Err(ShmError::BadHeader(format!(
                "file is {file_len} bytes, smaller than a header page"
            )));
        }
        let mut opts = MmapOptions::new();
        opts.len(file_len as usize);
        let map = match access {
            Access::ReadOnly => opts.map_raw_read_only(&fd),
            Access::ReadWrite => opts.map_raw(&fd),
        }
        .map_err(|source| ShmError::Io { op: "mmap", source })?;
        let base = map.as_ptr();
        // SAFETY: the mapping is at least one page long (checked above) and the fixed header
        // fields live in its first 40 bytes. The creator wrote them before sending the fd.
        let (magic, id, nslots, hdr, data_len, slot_size) = unsafe {
            (
                (base as *const u64).read(),
                (base.add(8) as *const u32).read(),
                (base.add(12) as *const u32).read(),
                (base.add(16) as *const u64).read(),
                (base.add(24) as *const u64).read(),
                (base.add(32) as *const u64).read(),
            )
        };
        if magic != REGION_MAGIC {
            return Err(ShmError::BadHeader(format!("magic {magic:#018x}")));
        }
        if nslots == 0 || nslots > MAX_SLOTS || slot_size == 0 {
            return Err(ShmError::BadHeader(format!(
                "region {id}: {nslots} slots of {slot_size} bytes"
            )));
        }
        if hdr != header_len(nslots) as u64 {
            return Err(ShmError::BadHeader(format!(
                "region {id}: header length {hdr} does not match {nslots} slots"
            )));
        }
        let want = slot_size
            .checked_mul(nslots as u64)
            .filter(|&d| d == data_len)
            .and_then(|d| d.checked_add(hdr));
        if want != Some(file_len) {
            return Err(ShmError::BadHeader(format!(
                "region {id}: header says {nslots} x {slot_size} data bytes after {hdr} header \
                 bytes, but the file is {file_len} bytes"
            )));
        }
        Ok(Region {
            id,
            fd,
            map,
            data_offset: hdr as usize,
            data_len: data_len as usize,
            slot_size: slot_size as usize,
            nslots,
            access,
        })
    }

    /// Region id.
    pub fn id(&self) -> u32 {
        self.id
    }
    /// The memfd, to pass to another process (it is `CLOEXEC`; SCM_RIGHTS still passes it).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
    /// A duplicate of the memfd (e.g. to keep in a table or to send later).
    pub fn try_clone_fd(&self) -> Result<OwnedFd, ShmError> {
        self.fd
            .try_clone()
            .map_err(|source| ShmError::Io { op: "dup", source })
    }
    /// Bytes in the data area.
    pub fn data_len(&self) -> usize {
        self.data_len
    }
    /// Bytes per slot.
    pub fn slot_size(&self) -> usize {
        self.slot_size
    }
    /// Number of slots.
    pub fn nslots(&self) -> u32 {
        self.nslots
    }
    /// How this process mapped the region.
    pub fn access(&self) -> Access {
        self.access
    }
    /// Start of the data area in this process's mapping.
    pub fn data_ptr(&self) -> *mut u8 {
        // SAFETY: data_offset <= mapping length (validated at create/open).
        unsafe { self.map.as_mut_ptr().add(self.data_offset) }
    }

    fn gen_word(&self, slot: u64) -> &AtomicU64 {
        debug_assert!(slot < self.nslots as u64);
        // SAFETY: slot < nslots, so the word lies inside the header page(s), 8-aligned (the
        // mapping is page aligned, the table starts at 64). It lives as long as `self.map`.
        // Other processes only access it atomically.
        unsafe {
            &*(self.map.as_ptr().add(GEN_TABLE_OFFSET + 8 * slot as usize) as *const AtomicU64)
        }
    }

    /// Current generation of `slot`.
    pub fn generation(&self, slot: u32) -> Result<u64, ShmError> {
        if slot >= self.nslots {
            return Err(ShmError::BadGeometry(format!(
                "slot {slot} of region {} (has {})",
                self.id, self.nslots
            )));
        }
        Ok(self.gen_word(slot as u64).load(Ordering::Acquire))
    }

    /// Owner only: invalidate every outstanding handle into `slot` before rewriting it.
    /// Returns the new generation (use it for the handles made after the rewrite).
    pub fn bump_generation(&self, slot: u32) -> Result<u64, ShmError> {
        if self.access != Access::ReadWrite {
            return Err(ShmError::ReadOnly(self.id));
        }
        self.generation(slot)?;
        Ok(self.gen_word(slot as u64).fetch_add(1, Ordering::AcqRel) + 1)
    }

    /// A handle to `len` bytes at `offset_in_slot` inside `slot`, at the slot's current
    /// generation.
    pub fn handle(&self, slot: u32, offset_in_slot: u64, len: u64) -> Result<Handle, ShmError> {
        let generation = self.generation(slot)?;
        let h = Handle {
            region: self.id,
            offset: slot as u64 * self.slot_size as u64 + offset_in_slot,
            len,
            generation,
        };
        self.check(&h)?;
        Ok(h)
    }

    /// Check a handle against this region: id, bounds, single slot, generation.
    /// Returns the slot index.
    pub fn check(&self, h: &Handle) -> Result<u64, HandleError> {
        if h.region != self.id {
            return Err(HandleError::UnknownRegion(h.region));
        }
        let size = self.data_len as u64;
        let end = h.offset.checked_add(h.len);
        if !matches!(end, Some(e) if e <= size) {
            return Err(HandleError::OutOfBounds {
                region: h.region,
                offset: h.offset,
                len: h.len,
                size,
            });
        }
        let ss = self.slot_size as u64;
        let slot = (h.offset / ss).min(self.nslots as u64 - 1);
        if h.offset + h.len > (slot + 1) * ss {
            return Err(HandleError::CrossesSlot {
                region: h.region,
                offset: h.offset,
                len: h.len,
                slot,
                slot_size: ss,
            });
        }
        let current = self.gen_word(slot).load(Ordering::Acquire);
        if current != h.generation {
            return Err(HandleError::StaleGeneration {
                region: h.region,
                slot,
                handle: h.generation,
                current,
            });
        }
        Ok(slot)
    }

    /// Resolve a handle to the bytes it names in this process's mapping.
    ///
    /// # Safety
    /// The returned slice aliases shared memory that the owner process can write. The caller
    /// must make sure, by the pipeline protocol, that the owner does not write this range while
    /// the slice is alive (the owner only rewrites a slot after the reader released it, e.g.
    /// after `LayerDone`, and bumps the generation first). Use [`Region::check`] after use to
    /// detect a protocol violation.
    pub unsafe fn resolve(&self, h: &Handle) -> Result<&[u8], HandleError> {
        self.check(h)?;
        // SAFETY: bounds checked above; the mapping outlives `&self`; no concurrent writer by
        // the caller's contract.
        Ok(unsafe {
            std::slice::from_raw_parts(self.data_ptr().add(h.offset as usize), h.len as usize)
        })
    }

    /// Owner side: a mutable view of `len` bytes at data offset `offset`.
    ///
    /// # Safety
    /// No other reference (in this or another process) may read or write this range while the
    /// returned slice is alive: the slot must not be published, or must have been released by
    /// every reader and its generation bumped.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, offset: u64, len: u64) -> Result<&mut [u8], ShmError> {
        if self.access != Access::ReadWrite {
            return Err(ShmError::ReadOnly(self.id));
        }
        if !matches!(offset.checked_add(len), Some(e) if e <= self.data_len as u64) {
            return Err(HandleError::OutOfBounds {
                region: self.id,
                offset,
                len,
                size: self.data_len as u64,
            }
            .into());
        }
        // SAFETY: in bounds of a writable shared mapping; exclusivity by the caller's contract.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.data_ptr().add(offset as usize), len as usize)
        })
    }

    /// Owner side: copy `src` into the data area at `offset`.
    ///
    /// The pipeline protocol guarantees nobody reads a range while its owner rewrites it (see
    /// [`Region::resolve`]); this method only writes through the raw mapping pointer, never
    /// through a Rust reference that could alias a reader's slice.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), ShmError> {
        if self.access != Access::ReadWrite {
            return Err(ShmError::ReadOnly(self.id));
        }
        let len = src.len() as u64;
        if !matches!(offset.checked_add(len), Some(e) if e <= self.data_len as u64) {
            return Err(HandleError::OutOfBounds {
                region: self.id,
                offset,
                len,
                size: self.data_len as u64,
            }
            .into());
        }
        // SAFETY: destination in bounds of a writable mapping (checked above); `src` is a
        // separate Rust allocation or mapping so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.data_ptr().add(offset as usize),
                src.len(),
            )
        };
        Ok(())
    }

    /// First-touch every page of the region from this process, so that the pages are
    /// allocated now and charged to this process's memory cgroup (the owner pays).
    ///
    /// Uses `MADV_POPULATE_WRITE` (Linux 5.14+) on a writable mapping, falling back to
    /// touching one byte per page.
    pub fn prefault(&self) -> Result<(), ShmError> {
        let base = self.map.as_mut_ptr();
        let len = self.map.len();
        if self.access == Access::ReadWrite {
            // SAFETY: the range is exactly this process's live mapping.
            let r = unsafe {
                rustix::mm::madvise(base.cast(), len, rustix::mm::Advice::LinuxPopulateWrite)
            };
            if r.is_ok() {
                return Ok(());
            }
            // Fallback: read-modify-write nothing; an atomic fetch_add(0) on one word per page
            // faults the page in for writing without changing its contents (and without racing
            // with another process's atomic or plain writes to that word in a torn way).
            for off in (0..len).step_by(PAGE) {
                // SAFETY: `off` is page aligned and inside the mapping, so 8-aligned in bounds.
                unsafe { (*(base.add(off) as *const AtomicU64)).fetch_add(0, Ordering::Relaxed) };
            }
            Ok(())
        } else {
            // SAFETY: as above.
            unsafe { rustix::mm::madvise(base.cast(), len, rustix::mm::Advice::LinuxPopulateRead) }
                .map_err(io_err("madvise(MADV_POPULATE_READ)"))
        }
    }

    /// The file backing the region as a `File` (a dup), e.g. for `pread`/`O_DIRECT`-style
    /// I/O helpers that want one.
    pub fn dup_file(&self) -> Result<File, ShmError> {
        Ok(File::from(self.try_clone_fd()?))
    }
}

/// The reader-side table of regions received from other stages, keyed by region id.
#[derive(Default, Debug)]
pub struct RegionTable {
    regions: HashMap<u32, Arc<Region>>,
}

impl RegionTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Map a region received as an fd and add it. Returns its id (read from its header).
    pub fn insert_fd(&mut self, fd: OwnedFd, access: Access) -> Result<u32, ShmError> {
        self.insert(Arc::new(Region::open(fd, access)?))
    }

    /// Add an already mapped region (e.g. one created in this process, in `--inproc` mode).
    pub fn insert(&mut self, region: Arc<Region>) -> Result<u32, ShmError> {
        let id = region.id();
        if self.regions.contains_key(&id) {
            return Err(ShmError::DuplicateId(id));
        }
        self.regions.insert(id, region);
        Ok(id)
    }

    /// Remove a region (its mapping goes away when the last `Arc` does).
    pub fn remove(&mut self, id: u32) -> Option<Arc<Region>> {
        self.regions.remove(&id)
    }

    /// The region with this id.
    pub fn get(&self, id: u32) -> Option<&Arc<Region>> {
        self.regions.get(&id)
    }

    /// Number of regions mapped.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// True when no region is mapped.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// Check a handle (known region, bounds, slot, generation) without touching the bytes.
    pub fn check(&self, h: &Handle) -> Result<(), HandleError> {
        self.regions
            .get(&h.region)
            .ok_or(HandleError::UnknownRegion(h.region))?
            .check(h)
            .map(|_| ())
    }

    /// Resolve a handle to bytes in this process's mapping.
    ///
    /// # Safety
    /// Same contract as [`Region::resolve`]: the owner must not write the range while the
    /// slice is alive.
    pub unsafe fn resolve(&self, h: &Handle) -> Result<&[u8], HandleError> {
        let r = self
            .regions
            .get(&h.region)
            .ok_or(HandleError::UnknownRegion(h.region))?;
        // SAFETY: forwarded contract.
        unsafe { r.resolve(h) }
    }
}

/// A shared-memory region as the loaders' arena memory ([`k3_io::ArenaMemory`]): the
/// region's owner reads into it, peers map it read-only.
pub struct ShmArena(pub std::sync::Arc<Region>);

// SAFETY: `Region::data_ptr` is page aligned (4096), valid for `data_len` bytes of reads and
// writes for the region's lifetime (the Arc keeps it mapped), and the owning stage is the
// only writer; readers in other processes only read ranges the owner has published and not
// yet had released, which is the `ArenaMemory` contract's "disjoint slots".
unsafe impl k3_io::ArenaMemory for ShmArena {
    fn base(&self) -> *mut u8 {
        self.0.data_ptr()
    }
    fn len(&self) -> usize {
        self.0.data_len()
    }
}
