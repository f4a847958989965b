//! `k3-model`: the checkpoint as data, shared by every stage and the orchestrator.
//!
//! - [`config`]: the strict config.json reader (released shape; every problem listed at once).
//! - [`catalog`]: safetensors headers and indexes (single file or sharded), validated.
//! - [`tensor`]: dtypes, borrowed tensor views and the [`tensor::WeightSource`] trait.
//! - [`classify`]: the ONE place tensor names are parsed and formatted (layer, module,
//!   routed expert, class).
//! - [`mmap_weights`]: a [`tensor::WeightSource`] over memory-mapped shards.
//! - [`locator`]: where each routed expert's bytes are (runs in the shards).
//! - [`released`]: the released tensor list (names, shapes, dtypes) at full scale.
//! - [`trunk`]: the packed-trunk format (trunk.json + trunk.bin).
//! - [`experts`]: the packed-experts format (experts.json + experts.bin per drive directory).
//! - [`trunk`]: the packed-trunk format (trunk.json + trunk.bin, or its coded form).
//! - [`codec`]: the lossless BF16 codec a packed trunk can be stored with.
//! - [`codec_trunk`]: a coded trunk's chunks, and the reader that decodes them.
//!
//! Nothing here knows about processes, rings or stages.

pub mod catalog;
pub mod classify;
pub mod codec;
pub mod codec_trunk;
pub mod config;
pub mod experts;
pub mod locator;
pub mod mapfault;
pub mod mmap_weights;
pub mod released;
pub mod tensor;
pub mod trunk;
