//! A shard that shrinks while it is memory-mapped (truncated or rewritten by another
//! process during a run) turns the next read of a lost page into SIGBUS, which would end
//! the process with no message (exit 135). [`MmapWeights`](crate::mmap_weights::MmapWeights)
//! registers each mapping here; a SIGBUS handler looks the faulting address up, writes
//! `<file>: the file shrank while it was mapped (SIGBUS at byte N) ...` to stderr and ends
//! the process with `_exit(1)`, as a failed read ends a staged run. A fault outside every
//! registered mapping is given back to the handler that was there before (the Rust
//! runtime's, or the default action), so other faults behave as they always did.
//!
//! The handler only reads atomics and a path that stays allocated while its slot is
//! published, and calls `write(2)` and `_exit(2)`: async-signal-safe.

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::Once;

/// Mappings watched at once (a checkpoint has tens of shards; more are not watched).
const SLOTS: usize = 512;

struct Slot {
    used: AtomicBool,
    start: AtomicUsize,
    len: AtomicUsize,
    path: AtomicPtr<u8>,
    path_len: AtomicUsize,
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            used: AtomicBool::new(false),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            path: AtomicPtr::new(std::ptr::null_mut()),
            path_len: AtomicUsize::new(0),
        }
    }
}

static MAPS: [Slot; SLOTS] = [const { Slot::new() }; SLOTS];

/// The SIGBUS action that was installed before ours, written once before ours is.
struct OldAction(UnsafeCell<MaybeUninit<libc::sigaction>>);

// SAFETY: written exactly once, inside `INSTALL`, before the handler that reads it is
// installed; only read afterwards.
unsafe impl Sync for OldAction {}

static OLD: OldAction = OldAction(UnsafeCell::new(MaybeUninit::uninit()));
static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// A mapping watched for SIGBUS until this is dropped (drop it before the mapping).
pub struct Watched {
    slot: Option<usize>,
    /// The path's bytes, owned here while the slot points at them.
    _path: Box<[u8]>,
}

impl Drop for Watched {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            let s = &MAPS[i];
            s.start.store(0, Ordering::Release);
            s.len.store(0, Ordering::Release);
            s.path.store(std::ptr::null_mut(), Ordering::Release);
            s.path_len.store(0, Ordering::Release);
            s.used.store(false, Ordering::Release);
        }
    }
}

/// Watch `len` mapped bytes at `start` (file offset 0 of `path`) for SIGBUS, installing the
/// handler on first use. Never fails: with every slot taken, or a handler that cannot be
/// installed, a fault ends the process as before.
pub fn watch(start: *const u8, len: usize, path: &Path) -> Watched {
    install();
    let mut bytes: Box<[u8]> = path.as_os_str().as_encoded_bytes().into();
    if start.is_null() || len == 0 || !INSTALLED.load(Ordering::Acquire) {
        return Watched {
            slot: None,
            _path: bytes,
        };
    }
    for (i, s) in MAPS.iter().enumerate() {
        if s.used
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            s.path.store(bytes.as_mut_ptr(), Ordering::Release);
            s.path_len.store(bytes.len(), Ordering::Release);
            s.len.store(len, Ordering::Release);
            // Published last: the handler matches a slot only once its start is set.
            s.start.store(start as usize, Ordering::Release);
            return Watched {
                slot: Some(i),
                _path: bytes,
            };
        }
    }
    Watched {
        slot: None,
        _path: bytes,
    }
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: sigaction with a zeroed struct filled in here; the previous action is
        // stored in OLD before the new handler can run, and never written again.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigbus as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut act.sa_mask);
            let old = (*OLD.0.get()).as_mut_ptr();
            if libc::sigaction(libc::SIGBUS, std::ptr::null(), old) != 0 {
                return;
            }
            if libc::sigaction(libc::SIGBUS, &act, std::ptr::null_mut()) == 0 {
                INSTALLED.store(true, Ordering::Release);
            }
        }
    });
}

/// Append `b` to `buf` at `*n`, as far as it fits.
fn put(buf: &mut [u8], n: &mut usize, b: &[u8]) {
    let k = b.len().min(buf.len() - *n);
    buf[*n..*n + k].copy_from_slice(&b[..k]);
    *n += k;
}

/// Append `v` in decimal.
fn put_num(buf: &mut [u8], n: &mut usize, mut v: usize) {
    let mut d = [0u8; 20];
    let mut i = d.len();
    loop {
        i -= 1;
        d[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    put(buf, n, &d[i..]);
}

/// The message for a fault at byte `offset` of the file `path`.
#[doc(hidden)]
pub fn message(buf: &mut [u8], path: &[u8], offset: usize) -> usize {
    let mut n = 0;
    put(buf, &mut n, b"k3-orch: ");
    put(buf, &mut n, path);
    put(
        buf,
        &mut n,
        b": the file shrank while it was mapped (SIGBUS at byte ",
    );
    put_num(buf, &mut n, offset);
    put(
        buf,
        &mut n,
        b"): a shard was truncated or rewritten during the run\n",
    );
    n
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    for s in MAPS.iter() {
        let start = s.start.load(Ordering::Acquire);
        let len = s.len.load(Ordering::Acquire);
        if start == 0 || addr < start || addr - start >= len {
            continue;
        }
        let p = s.path.load(Ordering::Acquire);
        let plen = s.path_len.load(Ordering::Acquire);
        let path: &[u8] = if p.is_null() {
            b"a mapped shard"
        } else {
            // SAFETY: the slot's path stays allocated while the slot is published (the
            // `Watched` that owns it clears the slot before freeing it).
            unsafe { std::slice::from_raw_parts(p, plen) }
        };
        // Small: the handler may run on a thread's alternate signal stack.
        let mut buf = [0u8; 1024];
        let n = message(&mut buf, path, addr - start);
        // SAFETY: write(2) and _exit(2) are async-signal-safe; buf outlives the call.
        unsafe {
            libc::write(2, buf.as_ptr().cast(), n);
            libc::_exit(1);
        }
    }
    // Not one of ours: put the previous action back and return; the access faults again
    // and meets it (the Rust runtime's handler, or the default: end by SIGBUS).
    // SAFETY: OLD was written before this handler was installed.
    unsafe {
        libc::sigaction(libc::SIGBUS, (*OLD.0.get()).as_ptr(), std::ptr::null_mut());
    }
}
