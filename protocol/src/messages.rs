//! The messages stages exchange, and their wire encoding (serde + bincode 2, standard config).
//!
//! One enum, [`Msg`], covers every link (orchestrator <-> stage control, compute <-> tokenizer,
//! compute <-> trunk-loader, compute <-> expert-fetcher). Bulk data never travels in a message:
//! weights and expert bytes are referenced by [`Handle`]s into shared regions.
//!
//! Tokenizer payloads are deliberately generic (ids as `Vec<u32>`, raw bytes, chat as a JSON
//! string) so the tokenizer crate's own types can be carried without this crate depending on
//! it.
//!
//! The encoding is `bincode::serde` with `bincode::config::standard()` (varint integers,
//! little endian) and a decode limit of [`MAX_MESSAGE_BYTES`]; decoding refuses trailing
//! bytes, so one frame is exactly one message. Replay compares these bytes, so the encoding of
//! a given `Msg` value must stay deterministic (no maps with unordered keys in messages).

use serde::{Deserialize, Serialize};

use crate::shm::Handle;
use k3_model::tensor::Dtype;

/// Upper bound on an encoded message (and on what the decoder will allocate).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Protocol version carried in `Hello`; a mismatch is refused.
pub const PROTOCOL_VERSION: u32 = 1;

/// The processes of the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Stage {
    Orchestrator,
    Tokenizer,
    TrunkLoader,
    ExpertFetcher,
    LayerCompute,
}

impl Stage {
    /// Every stage process (not the orchestrator), in start order.
    pub const WORKERS: [Stage; 4] = [
        Stage::Tokenizer,
        Stage::TrunkLoader,
        Stage::ExpertFetcher,
        Stage::LayerCompute,
    ];

    /// The CLI / report spelling (`tokenizer`, `trunk-loader`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Stage::Orchestrator => "orchestrator",
            Stage::Tokenizer => "tokenizer",
            Stage::TrunkLoader => "trunk-loader",
            Stage::ExpertFetcher => "expert-fetcher",
            Stage::LayerCompute => "layer-compute",
        }
    }

    /// Parse the CLI spelling.
    pub fn parse(s: &str) -> Option<Stage> {
        [Stage::Orchestrator]
            .into_iter()
            .chain(Stage::WORKERS)
            .find(|st| st.name() == s)
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor inside a layer blob published by the trunk-loader.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpan {
    /// Checkpoint tensor name.
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Where its bytes are.
    pub handle: Handle,
}

/// What a region handed over the control socket is for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegionRole {
    /// A two-ring message link (see `transport::ShmTransport`); `side` is the receiver's end.
    Link {
        peer: Stage,
        side: crate::transport::Side,
        /// Pid of the process at the other end, for its death watch (0: watch the control
        /// socket instead).
        peer_pid: u32,
    },
    /// Read-only data (trunk slots, expert arena, embeddings...).
    Data { name: String },
}

/// Per-step statistics compute sends to the orchestrator (cli.md JSON `steps`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// Step index (0 = first generated token).
    pub step: u32,
    /// The token id produced.
    pub token: u32,
    /// Wall seconds of this step.
    pub seconds: f64,
    pub trunk_read_bytes: u64,
    pub expert_read_bytes: u64,
    pub expert_requests: u64,
    pub resident_hits: u64,
    /// Routed experts that failed to load during this step.
    pub expert_failures: u64,
    /// Seconds compute waited for I/O this step.
    pub io_wait_seconds: f64,
}

/// A message between stages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Msg {
    // --- lifecycle (orchestrator <-> every stage)
    /// First message of a stage on its control socket.
    Hello {
        stage: Stage,
        pid: u32,
        version: u32,
    },
    /// Sent by the orchestrator right after `Hello`: the run's options as JSON (stage-specific).
    Configure {
        json: String,
    },
    /// A region follows as an fd on the control socket (SCM_RIGHTS, one fd per message).
    Region {
        id: u32,
        role: RegionRole,
    },
    /// The stage has everything it needs and is serving.
    Ready {
        stage: Stage,
    },
    /// Health probe and its answer.
    Ping {
        nonce: u64,
    },
    Pong {
        nonce: u64,
    },
    /// Stop cleanly.
    Shutdown,
    /// A stage reports a failure it cannot recover from (its kind, for the orchestrator to
    /// match, and its message).
    Error {
        stage: Stage,
        failure: crate::failure::StageFailure,
    },

    // --- tokenizer
    EncodeText {
        req: u64,
        text: String,
        allow_specials: bool,
    },
    EncodeBytes {
        req: u64,
        bytes: Vec<u8>,
        allow_specials: bool,
    },
    /// `chat_json`: the tokenizer's chat request, serialised by the tokenizer crate.
    EncodeChat {
        req: u64,
        chat_json: String,
    },
    Ids {
        req: u64,
        ids: Vec<u32>,
    },
    /// Decode one generated id for streaming output.
    DecodeId {
        id: u32,
    },
    /// Decoded bytes (may be an incomplete UTF-8 sequence; the consumer concatenates).
    Text {
        bytes: Vec<u8>,
    },

    // --- trunk (compute <-> trunk-loader)
    /// A forward pass starts: positions `[start, start + len)`.
    StartPass {
        pass: u64,
        start: u32,
        len: u32,
    },
    /// Layer `layer` is in a slot; `handle` covers the whole blob, `tensors` its parts.
    LayerReady {
        pass: u64,
        layer: u32,
        handle: Handle,
        tensors: Vec<TensorSpan>,
    },
    /// Compute is done with layer `layer`'s slot; the loader may reuse it.
    LayerDone {
        pass: u64,
        layer: u32,
    },
    // --- experts (compute <-> expert-fetcher)
    /// Routed experts for `layer` (top-k order). Each published expert's slot stays held
    /// for compute until its `ExpertsDone`.
    Experts {
        pass: u64,
        layer: u32,
        ids: Vec<u32>,
    },
    ExpertReady {
        pass: u64,
        layer: u32,
        id: u32,
        handle: Handle,
    },
    ExpertFailed {
        pass: u64,
        layer: u32,
        id: u32,
        error: String,
    },
    /// Compute is done with these experts of `layer`: the fetcher releases their slots
    /// (until then they are never evicted, so a slot compute reads is never rewritten).
    /// Compute sends one per expert as soon as its product is done, during the batch: a
    /// batch larger than the arena's free slots reuses each slot once it comes back.
    ExpertsDone {
        pass: u64,
        layer: u32,
        ids: Vec<u32>,
    },

    /// trunk-loader -> compute after the last `LayerDone` of a pass: what serving it cost.
    TrunkPassDone {
        pass: u64,
        /// Layers bound in this pass, and how many of them were resident pinned layers.
        binds: u64,
        hits: u64,
        read_bytes: u64,
        io_seconds: f64,
    },
    /// expert-fetcher -> compute after the last `ExpertReady`/`ExpertFailed` of a batch.
    ExpertBatchDone {
        pass: u64,
        layer: u32,
        requests: u64,
        /// Served from experts resident before this step began (the TRUE resident hits).
        resident_hits: u64,
        failed: u64,
        read_bytes: u64,
        io_seconds: f64,
    },
    /// A stage's final counters (JSON), sent to the orchestrator when it shuts down.
    Summary {
        stage: Stage,
        json: String,
    },

    // --- reporting (compute -> orchestrator)
    StepStats(StepStats),
    /// Generation finished.
    Finished {
        generated: Vec<u32>,
    },

    // --- warm requests (orchestrator <-> a warm layer-compute, on its control socket)
    /// Start one request on a warm compute stage (`ComputeConf::warm`): the stages stay up
    /// between requests and compute keeps session states for prefix reuse.
    Generate(GenRequest),
    /// compute -> orchestrator: the request started; its first `cached_tokens` prompt tokens
    /// come from a kept session state (not prefilled again).
    RequestStarted {
        req: u64,
        cached_tokens: u32,
    },
    /// orchestrator -> compute: end request `req` after the step in progress (a stop string
    /// was decoded, the client went away). A one-shot run's request is 0. A stop for a request
    /// that is not running is ignored.
    StopRequest {
        req: u64,
    },
    /// compute -> orchestrator: request `req` is finished; the ids it generated.
    RequestDone {
        req: u64,
        generated: Vec<u32>,
    },
    /// A stage's progress through a long phase (the trunk load in bytes, the prefill in
    /// layers), for the progress line on stderr.
    Progress {
        stage: Stage,
        phase: String,
        done: u64,
        total: u64,
    },

    // --- the trunk below layer granularity (compute <-> trunk-loader)
    /// Part `part` (of `parts`, in use order) of layer `layer` is in a slot: the tensors the
    /// forward uses together (attention; FFN input side; dense FFN down-projection; see
    /// `k3_model::trunk::use_phase`). Sent instead of `LayerReady` when the trunk streams
    /// in parts; compute answers each with `PartDone` as soon as it stops using them.
    PartReady {
        pass: u64,
        layer: u32,
        part: u32,
        parts: u32,
        tensors: Vec<TensorSpan>,
    },
    /// Compute is done with part `part` of layer `layer`; the loader may reuse its slot.
    PartDone {
        pass: u64,
        layer: u32,
        part: u32,
    },

    // --- saved sessions on a warm compute (`k3-orch chat`'s /save and /load), between
    // requests, on its control socket; each is answered by `StateDone`
    /// orchestrator -> compute: write the kept session state whose key is the longest proper
    /// prefix of `tokens` (the conversation so far) to `path`, in the state-file format
    /// (`k3_layer_compute::state`), with `fingerprint` naming the model.
    SaveState {
        req: u64,
        path: std::path::PathBuf,
        fingerprint: String,
        tokens: Vec<u32>,
    },
    /// orchestrator -> compute: read the state file at `path`, check it (version, checksum,
    /// `fingerprint`, shapes) and that its tokens start `tokens` (the loaded conversation),
    /// and keep it for prefix reuse (`cache_entries`: as in [`GenRequest`]).
    LoadState {
        req: u64,
        path: std::path::PathBuf,
        fingerprint: String,
        tokens: Vec<u32>,
        cache_entries: u32,
    },
    /// compute -> orchestrator: `SaveState`/`LoadState` `req` is done: the state covers
    /// `tokens` consumed tokens, or `error` says why nothing was saved or kept (the stage
    /// carries on either way).
    StateDone {
        req: u64,
        tokens: u32,
        error: Option<String>,
    },

    // --- several warm requests at once (continuous batching, `serve --parallel N`): a warm
    // compute runs every `Generate` it holds together, one row per decoding request per
    // pass, and reports per request and per pass
    /// compute -> orchestrator: request `req`'s `index`-th generated id (in order; the
    /// tokenizer gets the same id as `DecodeId`, in the same order, so the orchestrator
    /// pairs each with its `Text`).
    Token(TokenMsg),
    /// compute -> orchestrator: one forward pass over the requests it holds.
    PassStats(PassStats),
    /// compute -> orchestrator: request `req` failed on its own (its logits were not
    /// finite, it could not run); the others carry on. A pass that fails as a whole fails
    /// the stage instead.
    RequestFailed {
        req: u64,
        error: String,
    },
    /// compute -> expert-fetcher: a guess at `layer`'s routed experts in pass `pass`, made
    /// before its router runs (`--speculate on`). A hint only: the fetcher may read them
    /// into slots no request needs, at low priority, and never answers it; the real
    /// `Experts` for the layer follows as always.
    Guess {
        pass: u64,
        layer: u32,
        experts: Vec<u32>,
    },
}

/// One generated id of a warm request (see [`Msg::Token`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenMsg {
    pub req: u64,
    /// 0 for the request's first generated id.
    pub index: u32,
    pub token: u32,
    /// Routed experts that failed to load in the passes of this request since its last
    /// token (its prompt's passes included): any makes the id unsound.
    pub expert_failures: u64,
    /// The logits row the id was drawn from, when the request asked for it
    /// ([`GenRequest::keep_logits`]).
    pub logits: Option<Vec<f32>>,
}

/// One forward pass of a warm compute that runs several requests (see [`Msg::PassStats`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PassStats {
    /// Rows in the pass: one per decoding request, plus prompt tokens.
    pub rows: u32,
    pub decode_rows: u32,
    pub prefill_rows: u32,
    /// Requests holding a slot after the pass, and waiting for one.
    pub busy: u32,
    pub queued: u32,
    /// Wall seconds of the pass: forward plus sampling.
    pub seconds: f64,
    pub trunk_read_bytes: u64,
    pub expert_read_bytes: u64,
    /// Routed-expert lookups (the union over the pass's rows) and those served from
    /// experts already resident.
    pub expert_requests: u64,
    pub resident_hits: u64,
    pub expert_failures: u64,
    pub io_wait_seconds: f64,
}

/// One request of a warm compute stage (see [`Msg::Generate`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenRequest {
    pub req: u64,
    /// The whole prompt (compute finds the longest kept prefix of it itself).
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub gen: u32,
    pub sampler: crate::conf::SamplerConfig,
    /// Generation ends after one of these ids (it is kept in the output).
    pub stop_ids: Vec<u32>,
    /// Also keep the session state after this many prompt tokens (the end of the last
    /// complete chat message), when it is shorter than the prompt.
    pub snapshot_at: Option<u32>,
    /// Session states compute keeps for prefix reuse (0: none).
    pub cache_entries: u32,
    /// Send each step's logits row with its token ([`TokenMsg::logits`]; a debug endpoint).
    pub keep_logits: bool,
}

/// Encoding or decoding failed.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("encoding a message: {0}")]
    Encode(String),
    #[error("decoding a message: {0}")]
    Decode(String),
    #[error("decoding a message: {trailing} trailing bytes after a {used}-byte message")]
    Trailing { used: usize, trailing: usize },
    #[error("encoded message is {0} bytes, over the {MAX_MESSAGE_BYTES}-byte limit")]
    TooLarge(usize),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_MESSAGE_BYTES>()
}

/// Encode a message (the bytes travel in one transport frame).
pub fn encode(msg: &Msg) -> Result<Vec<u8>, CodecError> {
    let v = bincode::serde::encode_to_vec(msg, config())
        .map_err(|e| CodecError::Encode(e.to_string()))?;
    if v.len() > MAX_MESSAGE_BYTES {
        return Err(CodecError::TooLarge(v.len()));
    }
    Ok(v)
}

/// Decode exactly one message from `bytes`.
pub fn decode(bytes: &[u8]) -> Result<Msg, CodecError> {
    let (m, used): (Msg, usize) = bincode::serde::decode_from_slice(bytes, config())
        .map_err(|e| CodecError::Decode(e.to_string()))?;
    if used != bytes.len() {
        return Err(CodecError::Trailing {
            used,
            trailing: bytes.len() - used,
        });
    }
    Ok(m)
}
