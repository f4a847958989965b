//! Rank BPE on bytes (spec §5.2 step 5): start from single bytes and repeatedly merge the
//! adjacent pair whose concatenation has the lowest rank, the leftmost one on ties, until no
//! adjacent pair is a token.
//!
//! Two implementations with identical results: a linear scan per merge (tiktoken's shape,
//! fastest for the short pieces that dominate text) and a heap with lazy invalidation for
//! long pieces, where the scan would be quadratic. Heap entries are ordered by (rank, byte
//! position), so the pop order is exactly "lowest rank, then leftmost".

use crate::vocab::Vocab;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Pieces longer than this (bytes) use the heap.
pub const HEAP_THRESHOLD: usize = 256;

/// Encode one pre-token: the whole piece's rank if it is a token, else rank BPE.
#[inline]
pub fn encode_piece(v: &Vocab, piece: &[u8], out: &mut Vec<u32>) {
    encode_piece_with(v, piece, out, &mut Vec::new())
}

/// [`encode_piece`] with a reusable scratch buffer (no allocation per piece).
#[inline]
pub fn encode_piece_with(
    v: &Vocab,
    piece: &[u8],
    out: &mut Vec<u32>,
    scratch: &mut Vec<(usize, u32)>,
) {
    if piece.len() == 1 {
        out.push(v.byte(piece[0]));
        return;
    }
    if let Some(r) = v.get(piece) {
        out.push(r);
        return;
    }
    if piece.len() > HEAP_THRESHOLD {
        merge_heap(v, piece, out)
    } else {
        merge_scan_with(v, piece, out, scratch)
    }
}

/// Linear-scan rank BPE (no whole-piece lookup).
pub fn merge_scan(v: &Vocab, piece: &[u8], out: &mut Vec<u32>) {
    merge_scan_with(v, piece, out, &mut Vec::new())
}

fn merge_scan_with(v: &Vocab, piece: &[u8], out: &mut Vec<u32>, parts: &mut Vec<(usize, u32)>) {
    const NONE: u32 = u32::MAX;
    if piece.len() < 2 {
        out.extend(piece.iter().map(|&b| v.byte(b)));
        return;
    }
    // parts[i] = (start byte of part i, rank of part i merged with part i+1).
    parts.clear();
    for i in 0..piece.len() - 1 {
        parts.push((i, v.pair(piece[i], piece[i + 1])));
    }
    parts.push((piece.len() - 1, NONE));
    parts.push((piece.len(), NONE));
    let rank_at = |parts: &[(usize, u32)], i: usize| -> u32 {
        if i + 3 < parts.len() {
            v.get(&piece[parts[i].0..parts[i + 3].0]).unwrap_or(NONE)
        } else {
            NONE
        }
    };
    loop {
        let mut best = (NONE, 0usize);
        for (i, &(_, r)) in parts[..parts.len() - 1].iter().enumerate() {
            if r < best.0 {
                best = (r, i);
            }
        }
        if best.0 == NONE {
            break;
        }
        let i = best.1;
        parts[i].1 = rank_at(parts, i);
        if i > 0 {
            parts[i - 1].1 = rank_at(parts, i - 1);
        }
        parts.remove(i + 1);
    }
    for w in parts.windows(2) {
        // Every part is a token: a single byte, or a merge the vocab confirmed.
        out.push(v.get(&piece[w[0].0..w[1].0]).unwrap_or(NONE));
    }
}

/// Heap-based rank BPE (no whole-piece lookup); same result as [`merge_scan`].
pub fn merge_heap(v: &Vocab, piece: &[u8], out: &mut Vec<u32>) {
    let n = piece.len();
    // Parts as a linked list over byte positions: part starting at s spans s..next[s].
    const END: usize = usize::MAX;
    let mut next: Vec<usize> = (1..=n).collect();
    let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
    let mut alive = vec![true; n];
    let mut heap: BinaryHeap<Reverse<(u32, usize, usize)>> = BinaryHeap::new();
    // Entry (rank, left start, right end) is valid while left is alive, and the pair
    // left..next[left] + next[left]..next[next[left]] still ends at `right end`.
    let pair_end = |next: &Vec<usize>, s: usize| -> Option<usize> {
        let m = next[s];
        if m >= n {
            None
        } else {
            Some(next[m])
        }
    };
    for s in 0..n.saturating_sub(1) {
        let r = v.pair(piece[s], piece[s + 1]);
        if r != u32::MAX {
            heap.push(Reverse((r, s, s + 2)));
        }
    }
    while let Some(Reverse((r, s, e))) = heap.pop() {
        if !alive[s] || pair_end(&next, s) != Some(e) {
            continue;
        }
        // Merge s with its right neighbour m.
        let m = next[s];
        alive[m] = false;
        next[s] = e;
        if e < n {
            prev[e] = s;
        }
        let _ = r;
        // New pairs: (prev(s), s) and (s, next(s)).
        if let Some(pe) = pair_end(&next, s) {
            if let Some(r2) = v.get(&piece[s..pe]) {
                heap.push(Reverse((r2, s, pe)));
            }
        }
        let p = prev[s];
        if p != END && p < n {
            if let Some(r2) = v.get(&piece[p..e]) {
                heap.push(Reverse((r2, p, e)));
            }
        }
    }
    let mut s = 0;
    while s < n {
        out.push(v.get(&piece[s..next[s]]).unwrap_or(u32::MAX));
        s = next[s];
    }
}
