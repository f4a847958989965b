//! A coded trunk (`pack-trunk --codec`) read through the loader: the slots receive the raw
//! bytes, whole layers and any unaligned range alike, and a damaged chunk fails its layer
//! naming the layer and the chunk.

use std::sync::Arc;

use k3_io::MemFile as Mem;
use k3_io::ReadAt;
use k3_model::codec::{Codec, Effort};
use k3_model::codec_trunk::{encode_run, CodedReader};
use k3_model::tensor::Dtype;
use k3_model::trunk::{
    align_up, chunk_crcs, SourceIdentity, TrunkCodec, TrunkLayer, TrunkManifest, TrunkTensor,
    CODEC_CHUNK, CODED_BIN, TRUNK_CODED_FORMAT, TRUNK_FORMAT,
};
use k3_trunk_loader::loader::{decode_buffer_bytes, read_parallel, ChunkGrid, READ_QD};
use k3_trunk_loader::{plan, plan_streams, Piece, RingPolicy, Streams, TrunkLoader, Unit};

/// Gaussian-looking BF16 words (a few exponents, random sign and mantissa) of layer `l`.
fn run_bytes(l: usize, n: usize) -> Vec<u8> {
    let mut s = 0x2545_f491_4f6c_dd1du64 ^ l as u64;
    (0..n / 2)
        .flat_map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let e = 0x74 + (s % 5) as u16;
            ((e << 7) | ((s >> 8) as u16 & 0x807f)).to_le_bytes()
        })
        .collect()
}

/// A raw manifest and `trunk.bin` bytes for runs of these sizes, and the same trunk coded
/// (manifest and `trunk.k3z` bytes).
fn trunks(sizes: &[usize]) -> (TrunkManifest, Vec<u8>, TrunkManifest, Vec<u8>) {
    let (mut bin, mut k3z, mut layers, mut coded) = (vec![], vec![], vec![], vec![]);
    for (l, &n) in sizes.iter().enumerate() {
        let run = run_bytes(l, n);
        let offset = bin.len() as u64;
        bin.extend_from_slice(&run);
        bin.resize(align_up(bin.len() as u64, 4096) as usize, 0);
        layers.push(TrunkLayer {
            layer: l,
            offset,
            length: n as u64,
            padded_length: align_up(n as u64, 4096),
            shard: "s".into(),
            source_offset: 0,
            sha256: "0".repeat(64),
            crc32: chunk_crcs(&run),
            tensors: vec![TrunkTensor {
                name: format!("language_model.model.layers.{l}.x"),
                dtype: Dtype::BF16,
                shape: vec![n / 2],
                offset: 0,
                len: n as u64,
                crc32: chunk_crcs(&run),
            }],
        });
        let (bytes, mut cl) = encode_run(Codec::Bf16Zstd, l, &run, 4096, Effort::Level(1)).unwrap();
        cl.offset = k3z.len() as u64;
        k3z.extend_from_slice(&bytes);
        coded.push(cl);
    }
    let raw = TrunkManifest {
        format: TRUNK_FORMAT.into(),
        align: 4096,
        file: "trunk.bin".into(),
        file_size: bin.len() as u64,
        total_bytes: sizes.iter().sum::<usize>() as u64,
        max_run: *sizes.iter().max().unwrap() as u64,
        max_run_layer: sizes.iter().enumerate().max_by_key(|x| x.1).unwrap().0,
        source: SourceIdentity {
            total_size: 0,
            shards: vec![],
        },
        layers,
        codec: None,
    };
    let mut m = raw.clone();
    m.format = TRUNK_CODED_FORMAT.into();
    m.codec = Some(TrunkCodec {
        name: "bf16-zstd".into(),
        chunk: CODEC_CHUNK,
        file: CODED_BIN.into(),
        file_size: k3z.len() as u64,
        stored_bytes: coded.iter().flat_map(|c| &c.chunks).map(|c| c.stored).sum(),
        layers: coded,
        head: None,
    });
    assert_eq!(m.problems(), Vec::<String>::new());
    (raw, bin, m, k3z)
}

/// Any range of the raw layout, chunk-aligned or not, crossing layers and padding, reads
/// the same through the decoder as from `trunk.bin`: catches a chunk index off by one, a
/// partial chunk copied from its start instead of its offset, or padding left unzeroed.
#[test]
fn coded_reader_serves_the_raw_bytes_at_any_offset() {
    let sizes = [(5 << 20) + 6, (9 << 20) + 4098, 3000];
    let (_, bin, m, k3z) = trunks(&sizes);
    let r = CodedReader::new(&m, Arc::new(Mem(k3z)), 0).unwrap();
    let ranges = [
        (0u64, bin.len()),
        (4096, 1 << 20),
        ((4 << 20) - 3, 4097),
        ((5 << 20) + 1, 9 << 20),
        (bin.len() as u64 - 5000, 9000),
    ];
    for (off, len) in ranges {
        let mut dst = vec![0xAAu8; len];
        let got = r.read_at(0, off, &mut dst).unwrap();
        let end = (off as usize + len).min(bin.len());
        assert_eq!(got, end - off as usize, "at {off}");
        assert!(dst[..got] == bin[off as usize..end], "bytes at {off}+{len}");
    }
    assert!(r.stored_bytes_read() > 0 && r.decoded_bytes() > r.stored_bytes_read());
}

/// The loader over a coded trunk directory serves every layer's raw bytes, pinned and
/// streamed, token after token; the plan's decode buffers are counted; one flipped stored
/// byte fails that layer's acquire naming the layer and the chunk (exit 1 in the stage),
/// while the other layers are still served.
#[test]
fn loader_decodes_a_coded_trunk_and_names_a_damaged_chunk() {
    let sizes = [(5 << 20) + 6, (9 << 20) + 4098, 3000];
    let (raw, bin, m, mut k3z) = trunks(&sizes);
    assert_eq!(decode_buffer_bytes(&raw), 0);
    assert!(decode_buffer_bytes(&m) >= 8 * CODEC_CHUNK);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(CODED_BIN), &k3z).unwrap();
    std::fs::write(
        dir.path().join("trunk.json"),
        serde_json::to_vec(&m).unwrap(),
    )
    .unwrap();
    // One slot pinned, one streamed: layer 1 goes through the ring every token.
    let budget = align_up(sizes[0] as u64, 4096) + align_up(sizes[1] as u64, 4096);
    let (_, loader) =
        TrunkLoader::open_dir(dir.path(), budget, RingPolicy::default(), None).unwrap();
    assert!(loader.plan().ring_slots >= 1);
    for _ in 0..2 {
        for (l, ml) in m.layers.iter().enumerate() {
            let g = loader.layer(l).unwrap();
            let want = &bin[ml.offset as usize..(ml.offset + ml.length) as usize];
            assert!(&g[..ml.length as usize] == want, "layer {l}");
        }
    }
    drop(loader);
    let c = m.codec.as_ref().unwrap();
    let at = (c.layers[1].offset + c.layers[1].chunks[1].offset + 100) as usize;
    k3z[at] ^= 0x08;
    std::fs::write(dir.path().join(CODED_BIN), &k3z).unwrap();
    let (_, loader) =
        TrunkLoader::open_dir(dir.path(), 64 << 20, RingPolicy::default(), None).unwrap();
    assert!(loader.layer(0).is_ok());
    let e = loader.layer(1).err().unwrap().to_string();
    assert!(e.contains("trunk layer 1 chunk 1"), "{e}");
    assert!(loader.layer(2).is_ok());
}

/// The decoders (zstd context and chunk buffers) are pooled: reading every layer over and
/// over with the loader's parallel reads (threads spawned per read) creates at most one per
/// reader thread in flight, and the bytes stay the raw ones. Catches a context (or its
/// buffers) created per chunk or per layer read, as it was when each read's threads kept
/// their own.
#[test]
fn decoders_are_pooled_across_chunks_and_layers() {
    let sizes = [(17 << 20) + 6, (9 << 20) + 4098, 3000];
    let (_, bin, m, k3z) = trunks(&sizes);
    let r = CodedReader::new(&m, Arc::new(Mem(k3z)), 0).unwrap();
    assert_eq!(r.decoders_made(), 0);
    let mut chunks = 0;
    for _ in 0..4 {
        for l in &m.layers {
            let mut dst = vec![0u8; l.length as usize];
            let got = read_parallel(&r, 0, l.offset, &mut dst, None).unwrap();
            assert_eq!(got, dst.len());
            let end = (l.offset + l.length) as usize;
            assert!(dst == bin[l.offset as usize..end], "layer {}", l.layer);
            chunks += l.length.div_ceil(CODEC_CHUNK);
        }
    }
    let made = r.decoders_made();
    assert!(
        made >= 1 && made <= READ_QD as u64,
        "{made} decoders for {chunks} chunks"
    );
    assert!(chunks > 4 * READ_QD as u64);
}

/// A coded trunk plans with its manifest's stored sizes: the same memory as the raw trunk
/// (slots and pinned units hold decoded bytes), but each streamed unit reads the stored
/// bytes of its chunks. Catches a plan (the loader's and the orchestrator's, which share
/// `Streams::of_manifest`) that reads a coded trunk at its decoded size.
#[test]
fn a_coded_trunk_plans_with_its_stored_sizes() {
    let sizes = [(5 << 20) + 6, (9 << 20) + 4098, 3000];
    let (raw, _, m, _) = trunks(&sizes);
    let (rs, cs) = (Streams::of_manifest(&raw, 3), Streams::of_manifest(&m, 3));
    assert!(rs.layer_reads.is_empty() && rs.part_reads.is_empty());
    let c = m.codec.as_ref().unwrap();
    for (l, cl) in c.layers.iter().enumerate() {
        let stored: u64 = cl.chunks.iter().map(|x| x.stored).sum();
        assert_eq!(cs.layer_reads[l], stored, "layer {l}");
    }
    assert_eq!(cs.stored_bytes(), c.stored_bytes);
    assert!(cs.stored_bytes() < rs.stored_bytes());
    // One tensor per layer: one part per layer, reading its whole layer's chunks.
    assert_eq!(cs.part_reads, cs.layer_reads);
    let budget = align_up(sizes[0] as u64, 4096) + align_up(sizes[1] as u64, 4096);
    let (r, k) = (
        plan_streams(budget, &rs, RingPolicy::default()).unwrap(),
        plan_streams(budget, &cs, RingPolicy::default()).unwrap(),
    );
    assert_eq!(r.plan, k.plan);
    assert!(
        k.read_per_token > 0 && k.read_per_token < r.read_per_token,
        "coded {} raw {}",
        k.read_per_token,
        r.read_per_token
    );
}

/// A part that starts inside a chunk (a layer's second tensor) is read cut at the chunk's
/// end: each chunk it spans is read and decoded once, as `Streams::of_manifest` counts it,
/// and its bytes are the raw ones. Catches reads cut in `READ_CHUNK` pieces from the part's
/// first byte, which put every chunk boundary inside a piece and decode those chunks twice
/// (1.44x the stored bytes here).
#[test]
fn a_part_inside_a_chunk_decodes_each_chunk_once() {
    let sizes = [(81 << 20) + 6];
    let (_, bin, m, k3z) = trunks(&sizes);
    let coded = Arc::new(CodedReader::new(&m, Arc::new(Mem(k3z)), 0).unwrap());
    let (at, len) = (4096u64 * 3, 80u64 << 20);
    let unit = Unit {
        pieces: vec![Piece {
            offset: at,
            len,
            check: None,
            tensor_checks: Vec::new(),
        }],
    };
    let p = plan(unit.footprint(), &[unit.as_run()], RingPolicy::default()).unwrap();
    let arena = Arc::new(k3_io::arena::OwnedArena::new(p.bytes() as usize).unwrap());
    let grid = ChunkGrid::of(&m);
    assert_eq!(
        grid.as_ref().unwrap().cut(at, len as usize),
        Some((4 << 20) - 3 * 4096)
    );
    let reader: Arc<dyn ReadAt> = coded.clone();
    let loader =
        TrunkLoader::with_units_grid(vec![unit], p, reader, 0, arena, vec![], grid).unwrap();
    let g = loader.layer(0).unwrap();
    assert!(g[..len as usize] == bin[at as usize..(at + len) as usize]);
    let chunks = &m.codec.as_ref().unwrap().layers[0].chunks;
    let touched = (at / CODEC_CHUNK) as usize..=((at + len - 1) / CODEC_CHUNK) as usize;
    let once: u64 = chunks[touched].iter().map(|c| c.stored).sum();
    assert_eq!(coded.stored_bytes_read(), once);
}

/// The decode probe reads and decodes the trunk's own chunks (their CRCs checked) and
/// says how fast one core decodes them; a raw trunk has no rate, and a damaged chunk gives
/// none rather than a rate of what did not decode. Each manifest's streams record the
/// decoded bytes a streamed unit decodes (the raw trunk's: none). Catches a probe that
/// times something other than decoding these chunks (a damaged chunk would still give a
/// rate) and decoded sizes counted for a raw trunk.
#[test]
fn the_decode_probe_decodes_the_trunks_own_chunks() {
    let sizes = [(5 << 20) + 6, (9 << 20) + 4098, 3000];
    let (raw, _, m, mut k3z) = trunks(&sizes);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(CODED_BIN), &k3z).unwrap();
    let rate = k3_trunk_loader::decode_rate(dir.path(), &m, 4).expect("a rate");
    assert!(rate.is_finite() && rate > 0.0, "{rate}");
    assert_eq!(k3_trunk_loader::decode_rate(dir.path(), &raw, 4), None);
    let (rs, cs) = (Streams::of_manifest(&raw, 3), Streams::of_manifest(&m, 3));
    assert!(!rs.is_coded() && rs.layer_decoded.is_empty());
    assert!(cs.is_coded());
    assert_eq!(cs.layer_decoded, sizes.map(|n| n as u64).to_vec());
    // Every chunk picked: damage the first one.
    let c = m.codec.as_ref().unwrap();
    let at = (c.layers[0].offset + c.layers[0].chunks[0].offset + 100) as usize;
    k3z[at] ^= 0x08;
    std::fs::write(dir.path().join(CODED_BIN), &k3z).unwrap();
    assert_eq!(k3_trunk_loader::decode_rate(dir.path(), &m, 1000), None);
}

/// A file in memory that logs the range of every read.
struct Logged(Mem, std::sync::Mutex<Vec<(u64, u64)>>);
impl ReadAt for Logged {
    fn read_at(&self, file: u32, offset: u64, dst: &mut [u8]) -> std::io::Result<usize> {
        self.1.lock().unwrap().push((offset, dst.len() as u64));
        self.0.read_at(file, offset, dst)
    }
}

/// A layer kept coded (`--trunk-resident`): its stored run is read once into the arena,
/// then every read of it decodes from memory, never from the file, and serves the raw
/// bytes; the other layers still read their chunks. Its stored bytes are checked when
/// decoded, not when kept: a flipped byte keeps, then fails that layer's read naming the
/// layer and the chunk. Catches a kept layer still read from disk, one decoded from the
/// wrong place in memory (other bytes than the raw ones), a damaged kept chunk served
/// unchecked, and a run kept past its arena.
#[test]
fn a_layer_kept_coded_decodes_from_memory_and_names_a_damaged_chunk() {
    let sizes = [(5 << 20) + 6, (9 << 20) + 4098, 3000];
    let (_, bin, m, mut k3z) = trunks(&sizes);
    let c = m.codec.as_ref().unwrap().clone();
    let kept = &c.layers[1];
    assert_eq!(
        Streams::of_manifest(&m, 3).layer_kept,
        c.layers.iter().map(|l| l.padded_length).collect::<Vec<_>>()
    );
    let keep = |k3z: Vec<u8>| {
        let file = Arc::new(Logged(Mem(k3z), Default::default()));
        let mut r = CodedReader::new(&m, file.clone(), 0).unwrap();
        let small = Arc::new(k3_io::arena::OwnedArena::new(4096).unwrap());
        assert!(
            r.keep_layers(&[1], small, 0).is_err(),
            "kept past its arena"
        );
        let arena = k3_io::arena::OwnedArena::new(4096 + kept.padded_length as usize).unwrap();
        assert_eq!(
            r.keep_layers(&[1], Arc::new(arena), 4096).unwrap(),
            kept.padded_length
        );
        file.1.lock().unwrap().clear();
        (r, file)
    };
    let (r, file) = keep(k3z.clone());
    for _ in 0..2 {
        for l in &m.layers {
            let mut dst = vec![0u8; l.length as usize];
            assert_eq!(
                read_parallel(&r, 0, l.offset, &mut dst, None).unwrap(),
                dst.len()
            );
            let end = (l.offset + l.length) as usize;
            assert!(dst == bin[l.offset as usize..end], "layer {}", l.layer);
        }
    }
    let (from, to) = (kept.offset, kept.offset + kept.padded_length);
    let log = file.1.lock().unwrap().clone();
    assert!(!log.is_empty());
    assert!(
        log.iter().all(|&(o, n)| o + n <= from || o >= to),
        "a kept layer was read from the file: {log:?}"
    );
    let stored = |l: usize| -> u64 { c.layers[l].chunks.iter().map(|ch| ch.stored).sum() };
    assert_eq!(r.stored_bytes_kept(), 2 * stored(1));
    assert_eq!(r.stored_bytes_read(), 2 * (stored(0) + stored(2)));
    k3z[(kept.offset + kept.chunks[1].offset + 100) as usize] ^= 0x08;
    let (r, _) = keep(k3z);
    let read = |l: usize| {
        let ml = &m.layers[l];
        let mut dst = vec![0u8; ml.length as usize];
        read_parallel(&r, 0, ml.offset, &mut dst, None).map(|_| ())
    };
    assert!(read(0).is_ok() && read(2).is_ok());
    let e = read(1).unwrap_err().to_string();
    assert!(e.contains("trunk layer 1 chunk 1"), "{e}");
}
