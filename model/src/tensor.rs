//! Tensor dtypes, borrowed tensor views and the `WeightSource` trait.
//!
//! A `WeightSource` is how the forward pass receives weights: by name, as bytes plus dtype
//! and shape, borrowed from wherever a stage keeps them (an mmap of a shard, a trunk ring
//! slot, an expert arena slot). Compute never learns which.

use std::fmt;

/// Element types that appear in Kimi K3 checkpoints (and a few more safetensors allows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Dtype {
    BF16,
    F16,
    F32,
    F64,
    U8,
    I8,
    I16,
    I32,
    I64,
    BOOL,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::U8 | Dtype::I8 | Dtype::BOOL => 1,
            Dtype::BF16 | Dtype::F16 | Dtype::I16 => 2,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F64 | Dtype::I64 => 8,
        }
    }

    /// Parse the safetensors header spelling ("BF16", "F32", ...).
    pub fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "BF16" => Dtype::BF16,
            "F16" => Dtype::F16,
            "F32" => Dtype::F32,
            "F64" => Dtype::F64,
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            "I16" => Dtype::I16,
            "I32" => Dtype::I32,
            "I64" => Dtype::I64,
            "BOOL" => Dtype::BOOL,
            _ => return None,
        })
    }

    /// The safetensors header spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::BF16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::I16 => "I16",
            Dtype::I32 => "I32",
            Dtype::I64 => "I64",
            Dtype::BOOL => "BOOL",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A tensor borrowed from some backing store: raw little-endian bytes plus dtype and shape.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl TensorRef<'_> {
    /// Number of elements (1 for a rank-0 tensor).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Error from a `WeightSource`: the tensor is absent, or could not be made available.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("tensor {0} is not in the checkpoint")]
    Missing(String),
    #[error("tensor {name}: {msg}")]
    Invalid { name: String, msg: String },
    #[error("tensor {name}: read failed: {msg}")]
    Io { name: String, msg: String },
    /// The tensor holds a value that is not finite (a NaN or ±Inf BF16/F32 element, an
    /// E8M0 scale byte 0xFF): corrupt weights, never computed with.
    #[error("tensor {name} is not finite: {msg}")]
    NonFinite { name: String, msg: String },
}

/// Where the forward pass gets its weights. Implemented by the single-process model reader
/// (mmap of the shards) and by the staged pipeline (handles into loader-owned regions).
pub trait WeightSource {
    /// The tensor called `name` (full released name, e.g.
    /// `language_model.model.layers.3.self_attn.q_a_proj.weight`).
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError>;

    /// Whether `name` exists, without making it resident.
    fn contains(&self, name: &str) -> bool;
}
