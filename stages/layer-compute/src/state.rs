//! Saved session states (`--save-state FILE` / `--load-state FILE`): the carried state of
//! one sequence (MLA KV caches, KDA recurrent states and conv tails) with the tokens it has
//! seen, so a later run continues where this one stopped and gives the ids one
//! uninterrupted run would have given.
//!
//! The file:
//!
//! ```text
//! "K3STATE\n"                 8 bytes
//! version                     u32 LE (STATE_VERSION)
//! header length               u32 LE
//! header                      JSON: fingerprint, tokens, steps, layers, payload_bytes,
//!                             payload_sha256
//! payload                     little endian: pos u64, steps u64, tokens (u64 count, u32s),
//!                             layers u32, then per layer a tag (0 none, 1 KDA, 2 MLA) and
//!                             its f32 vectors (u64 count, values)
//! ```
//!
//! The fingerprint ([`fingerprint`]) names the model: a SHA-256 over config.json, the bound
//! layer count and every shard's name, size and safetensors header. A file is refused for
//! another fingerprint, another version, a payload whose SHA-256 does not match, or state
//! whose shapes do not fit the model. The tokens are every id the session consumed plus the
//! last generated one, which the next run feeds first.
//!
//! `k3-orch chat`'s `/save FILE` writes the same file (as `FILE.state`) from a kept prefix
//! state ([`encode_prefix`]): the tokens are the ones the state consumed plus the
//! conversation's next token (the one the next turn's prompt feeds first at that point),
//! and `steps` is 0 (each chat turn samples from step 0). `/load FILE` ([`decode_prefix`])
//! checks it like `--load-state` and also that its tokens start the loaded conversation,
//! and puts it back in the prefix cache, so the next turn prefills only what follows.

use std::path::{Path, PathBuf};

use crate::decode::PrefixCache;
use crate::forward::{Model, Session};
use crate::modules::kda::KdaState;
use crate::modules::mla::MlaCache;
use crate::weights::Weights;
use k3_model::config::LayerKind;
use k3_protocol::failure::FailureKind;

/// Version of the file layout.
pub const STATE_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"K3STATE\n";
/// Longest header accepted.
const MAX_HEADER: usize = 1 << 20;

/// Why a state could not be written, read or used. A file's errors come wrapped in
/// [`StateError::Load`] or [`StateError::Save`], which name the flag and the path.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A file of the model (config.json, a shard) could not be read for the fingerprint.
    #[error("{}: {source}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Catalog(#[from] k3_model::catalog::CatalogError),
    /// A shard's data sample could not be read for the fingerprint.
    #[error(transparent)]
    Source(#[from] k3_model::trunk::SourceError),
    /// Reading or writing the state file itself.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not a regular file")]
    NotAFile,
    #[error("not a k3 state file (written by --save-state)")]
    NotAState,
    #[error("state file version {0}; this k3-orch reads version {STATE_VERSION}")]
    Version(u32),
    #[error("the state file's header is truncated")]
    HeaderTruncated,
    #[error("the state file's header is unreadable: {0}")]
    Header(#[source] serde_json::Error),
    #[error(
        "the state was saved for another model or configuration (fingerprint {found}, this \
         run's is {want})"
    )]
    OtherModel { found: String, want: String },
    #[error("the state file is truncated or padded: {got} payload bytes, the header says {want}")]
    PayloadSize { got: usize, want: u64 },
    #[error("the state file is corrupt: its payload checksum (SHA-256) does not match")]
    Checksum,
    #[error("the state payload is truncated")]
    Truncated,
    /// The payload does not fit the model (layers, kinds, shapes, ids): what does not.
    #[error("{0}")]
    Mismatch(String),
    /// Encoding: the session and the tokens recorded for it disagree.
    #[error("the session consumed {pos} tokens but {recorded} are recorded (expected one more)")]
    TokenCount { pos: usize, recorded: usize },
    #[error("the state's header does not serialise: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("nothing was generated, so there is no state to save")]
    NothingGenerated,
    #[error("no tokens")]
    NoTokens,
    #[error(
        "no session state is kept for this conversation (no turn yet, or prefix reuse is off)"
    )]
    NoneKept,
    #[error(
        "the state ({state} tokens) is not a prefix of this conversation ({conversation} \
         tokens): it was saved for another conversation"
    )]
    OtherConversation { state: usize, conversation: usize },
    /// `--load-state PATH` (or `/load`): the file and what is wrong with it.
    #[error("--load-state {}: {source}", path.display())]
    Load {
        path: PathBuf,
        #[source]
        source: Box<StateError>,
    },
    /// `--save-state PATH`: the file and why it could not be written.
    #[error("--save-state {}: {source}", path.display())]
    Save {
        path: PathBuf,
        #[source]
        source: Box<StateError>,
    },
}

impl StateError {
    fn load(path: &Path) -> impl FnOnce(StateError) -> StateError + '_ {
        |e| StateError::Load {
            path: path.to_path_buf(),
            source: Box::new(e),
        }
    }

    fn save(path: &Path) -> impl FnOnce(StateError) -> StateError + '_ {
        |e| StateError::Save {
            path: path.to_path_buf(),
            source: Box::new(e),
        }
    }

    /// The failure kind a stage reports for it: writing a state is I/O; a state that cannot
    /// be read or used is the run's configuration.
    pub fn kind(&self) -> FailureKind {
        match self {
            StateError::Save { .. } => FailureKind::Io,
            _ => FailureKind::Config,
        }
    }

    /// The message without the flag: `PATH: why` for a file's error (what `/load` shows).
    pub fn without_flag(&self) -> String {
        match self {
            StateError::Load { path, source } | StateError::Save { path, source } => {
                format!("{}: {source}", path.display())
            }
            e => e.to_string(),
        }
    }
}

/// What the header says.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Header {
    pub fingerprint: String,
    pub tokens: u64,
    pub steps: u64,
    pub layers: u64,
    pub payload_bytes: u64,
    pub payload_sha256: String,
}

/// A loaded state.
pub struct Saved {
    /// Every id the session consumed, then the last generated id (not consumed yet).
    pub tokens: Vec<u32>,
    /// Generation steps taken so far (the sampler's next step number).
    pub steps: u64,
    pub session: Session,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn sha256_hex(b: &[u8]) -> String {
    hex(&k3_protocol::record::sha256(b))
}

/// The model's fingerprint: SHA-256 over config.json, the bound layer count, each shard's
/// file name, size and safetensors header (in the catalog's shard order), and each shard's
/// sampled data digest (`k3_model::trunk::SourceIdentity`, as `pack-trunk` records it:
/// two checkpoints of one layout have the same headers, not the same data).
pub fn fingerprint(
    config_path: &Path,
    model_dir: &Path,
    layers: usize,
) -> Result<String, StateError> {
    use std::io::Read;
    let file = |path: &Path| {
        let path = path.to_path_buf();
        move |source| StateError::File { path, source }
    };
    let config = k3_io::input::read_capped(config_path, k3_io::input::JSON_CAP)
        .map_err(file(config_path))?;
    let cat = k3_model::catalog::Catalog::open(model_dir)?;
    let mut buf = Vec::new();
    buf.extend_from_slice(b"k3 state fingerprint 2\n");
    buf.extend_from_slice(&(config.len() as u64).to_le_bytes());
    buf.extend_from_slice(&config);
    buf.extend_from_slice(&(layers as u64).to_le_bytes());
    for sh in cat.shards() {
        let name = sh
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut f = k3_io::input::open_regular(&sh.path).map_err(file(&sh.path))?;
        let size = f.metadata().map_err(file(&sh.path))?.len();
        let mut n = [0u8; 8];
        f.read_exact(&mut n).map_err(file(&sh.path))?;
        let hlen = u64::from_le_bytes(n)
            .min(size.saturating_sub(8))
            .min(256 << 20);
        let mut header = vec![0u8; hlen as usize];
        f.read_exact(&mut header).map_err(file(&sh.path))?;
        buf.extend_from_slice(&(name.len() as u64).to_le_bytes());
        buf.extend_from_slice(name.as_bytes());
        buf.extend_from_slice(&size.to_le_bytes());
        buf.extend_from_slice(&hlen.to_le_bytes());
        buf.extend_from_slice(&header);
    }
    for sh in k3_model::trunk::SourceIdentity::of(&cat)?.shards {
        buf.extend_from_slice(&(sh.file.len() as u64).to_le_bytes());
        buf.extend_from_slice(sh.file.as_bytes());
        buf.extend_from_slice(sh.sample_sha256.as_bytes());
    }
    Ok(sha256_hex(&buf))
}

fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn put_f32s(b: &mut Vec<u8>, v: &[f32]) {
    put_u64(b, v.len() as u64);
    b.reserve(v.len() * 4);
    for x in v {
        b.extend_from_slice(&x.to_le_bytes());
    }
}

/// The file bytes of a session that consumed `tokens[..len-1]`.
pub fn encode(
    fingerprint: &str,
    tokens: &[u32],
    steps: u64,
    session: &Session,
) -> Result<Vec<u8>, StateError> {
    let (pos, kda, mla) = session.parts();
    if tokens.len() != pos + 1 {
        return Err(StateError::TokenCount {
            pos,
            recorded: tokens.len(),
        });
    }
    let mut p = Vec::new();
    put_u64(&mut p, pos as u64);
    put_u64(&mut p, steps);
    put_u64(&mut p, tokens.len() as u64);
    for t in tokens {
        p.extend_from_slice(&t.to_le_bytes());
    }
    p.extend_from_slice(&(kda.len() as u32).to_le_bytes());
    for (l, k) in kda.iter().enumerate() {
        match (k, mla.get(l).and_then(Option::as_ref)) {
            (Some(s), _) => {
                p.push(1);
                for v in [&s.s, &s.conv_q, &s.conv_k, &s.conv_v] {
                    put_f32s(&mut p, v);
                }
            }
            (None, Some(c)) => {
                p.push(2);
                put_u64(&mut p, c.len as u64);
                for v in [&c.latent, &c.k_rope, &c.k_nope, &c.v] {
                    put_f32s(&mut p, v);
                }
            }
            (None, None) => p.push(0),
        }
    }
    let header = Header {
        fingerprint: fingerprint.to_string(),
        tokens: tokens.len() as u64,
        steps,
        layers: kda.len() as u64,
        payload_bytes: p.len() as u64,
        payload_sha256: sha256_hex(&p),
    };
    let h = serde_json::to_vec(&header).map_err(StateError::Encode)?;
    let mut out = Vec::with_capacity(16 + h.len() + p.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&STATE_VERSION.to_le_bytes());
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(&p);
    Ok(out)
}

/// Write a state file atomically (`k3_io::output`).
pub fn save(
    path: &Path,
    fingerprint: &str,
    tokens: &[u32],
    steps: u64,
    session: &Session,
) -> Result<(), StateError> {
    let bytes = encode(fingerprint, tokens, steps, session)?;
    k3_io::output::write_atomic(path, &bytes).map_err(|e| StateError::save(path)(e.into()))
}

/// Check a file's magic, version, model and checksum; returns the header and the payload.
pub fn check<'a>(bytes: &'a [u8], fingerprint: &str) -> Result<(Header, &'a [u8]), StateError> {
    if bytes.len() < 16 || &bytes[..8] != MAGIC {
        return Err(StateError::NotAState);
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or_default());
    if version != STATE_VERSION {
        return Err(StateError::Version(version));
    }
    let hlen = u32::from_le_bytes(bytes[12..16].try_into().unwrap_or_default()) as usize;
    if hlen > MAX_HEADER || 16 + hlen > bytes.len() {
        return Err(StateError::HeaderTruncated);
    }
    let header: Header =
        serde_json::from_slice(&bytes[16..16 + hlen]).map_err(StateError::Header)?;
    if header.fingerprint != fingerprint {
        return Err(StateError::OtherModel {
            found: header.fingerprint,
            want: fingerprint.to_string(),
        });
    }
    let payload = &bytes[16 + hlen..];
    if payload.len() as u64 != header.payload_bytes {
        return Err(StateError::PayloadSize {
            got: payload.len(),
            want: header.payload_bytes,
        });
    }
    if sha256_hex(payload) != header.payload_sha256 {
        return Err(StateError::Checksum);
    }
    Ok((header, payload))
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], StateError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or(StateError::Truncated)?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u64(&mut self) -> Result<u64, StateError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap_or_default(),
        ))
    }
    fn u32(&mut self) -> Result<u32, StateError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or_default(),
        ))
    }
    fn u8(&mut self) -> Result<u8, StateError> {
        Ok(self.take(1)?[0])
    }
    fn count(&mut self, elem: usize) -> Result<usize, StateError> {
        let n = self.u64()?;
        let left = (self.b.len() - self.at) as u64;
        if n.saturating_mul(elem as u64) > left {
            return Err(StateError::Truncated);
        }
        Ok(n as usize)
    }
    fn f32s(&mut self, want: usize, what: &str) -> Result<Vec<f32>, StateError> {
        let n = self.count(4)?;
        if n != want {
            return Err(StateError::Mismatch(format!(
                "{what} holds {n} values where the model needs {want}"
            )));
        }
        Ok(self
            .take(n * 4)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect())
    }
}

/// The ids a checked payload records (every id the session consumed, then the last
/// generated one), read without a model: what a run checks against its vocabulary up
/// front.
pub fn tokens(payload: &[u8]) -> Result<Vec<u32>, StateError> {
    let mut r = Reader { b: payload, at: 0 };
    let _pos = r.u64()?;
    let _steps = r.u64()?;
    let nt = r.count(4)?;
    (0..nt).map(|_| r.u32()).collect()
}

/// Read a checked payload into a session for `model`, checking every shape against it.
pub fn decode<W: Weights>(payload: &[u8], model: &Model<W>) -> Result<Saved, StateError> {
    let mismatch = StateError::Mismatch;
    let mut r = Reader { b: payload, at: 0 };
    let pos = r.u64()?;
    let steps = r.u64()?;
    let nt = r.count(4)?;
    // Checked: a position of 2^64 - 1 has no "one more" (`examples/fuzz_state` found the
    // overflow).
    if pos.checked_add(1) != Some(nt as u64) {
        return Err(mismatch(format!(
            "the state records {nt} tokens for a session of {pos} (expected one more)"
        )));
    }
    // Below the token count, which the payload's length bounds.
    let pos = pos as usize;
    let tokens: Vec<u32> = (0..nt).map(|_| r.u32()).collect::<Result<_, _>>()?;
    let vocab = model.vocab() as u32;
    if let Some(t) = tokens.iter().find(|&&t| t >= vocab) {
        return Err(mismatch(format!(
            "the state holds id {t}, outside the vocabulary"
        )));
    }
    let layers = r.u32()? as usize;
    let fresh = model.new_session();
    let want_layers = fresh.parts().1.len();
    if layers != want_layers {
        return Err(mismatch(format!(
            "the state has {layers} layers, the model binds {want_layers}"
        )));
    }
    let kd = model.kda_geometry();
    let (state_len, tail_len) = KdaState::lens(&kd);
    let md = model.mla_geometry();
    let mut kda = vec![None; layers];
    let mut mla = vec![None; layers];
    for l in 0..layers {
        let kind = model.cfg.layer_kind(l);
        match (r.u8()?, kind) {
            (0, _) if pos == 0 => {}
            (1, LayerKind::Kda) => {
                kda[l] = Some(KdaState {
                    s: r.f32s(state_len, "a KDA state")?,
                    conv_q: r.f32s(tail_len, "a KDA conv tail")?,
                    conv_k: r.f32s(tail_len, "a KDA conv tail")?,
                    conv_v: r.f32s(tail_len, "a KDA conv tail")?,
                })
            }
            (2, LayerKind::Mla) => {
                let len = r.u64()? as usize;
                if len != pos {
                    return Err(mismatch(format!(
                        "layer {l}'s KV cache holds {len} positions, the session {pos}"
                    )));
                }
                mla[l] = Some(MlaCache {
                    len,
                    latent: r.f32s(len * md.kv_lora, "an MLA latent cache")?,
                    k_rope: r.f32s(len * md.rope, "an MLA rope cache")?,
                    k_nope: r.f32s(len * md.heads * md.nope, "an MLA key cache")?,
                    v: r.f32s(len * md.heads * md.v, "an MLA value cache")?,
                })
            }
            (tag, kind) => {
                return Err(mismatch(format!(
                    "layer {l} is {kind:?} but the state holds kind {tag} for it"
                )))
            }
        }
    }
    if r.at != payload.len() {
        return Err(mismatch(format!(
            "{} bytes after the last layer of the state",
            payload.len() - r.at
        )));
    }
    Ok(Saved {
        tokens,
        steps,
        session: Session::from_parts(pos, kda, mla),
    })
}

/// Read, check and decode a state file for `model`.
pub fn load<W: Weights>(
    path: &Path,
    fingerprint: &str,
    model: &Model<W>,
) -> Result<Saved, StateError> {
    let bytes = read(path)?;
    let (_, payload) = check(&bytes, fingerprint).map_err(StateError::load(path))?;
    decode(payload, model).map_err(StateError::load(path))
}

/// A state file's bytes, for [`check`]. Only a regular file is opened (never blocking on
/// a FIFO), and its magic, version, header and size are checked before the rest is read:
/// a file that is not a state (a 3 GB log, `/dev/zero`) is refused after 16 bytes, and one
/// whose size is not what its header says before its payload is read.
pub fn read(path: &Path) -> Result<Vec<u8>, StateError> {
    use std::io::Read;
    let load = |e: StateError| StateError::Load {
        path: path.to_path_buf(),
        source: Box::new(e),
    };
    let mut f = k3_io::input::open_regular(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidInput => load(StateError::NotAFile),
        _ => load(e.into()),
    })?;
    let size = f.metadata().map_err(|e| load(e.into()))?.len();
    let mut head = [0u8; 16];
    if size < 16 {
        return Err(load(StateError::NotAState));
    }
    f.read_exact(&mut head).map_err(|e| load(e.into()))?;
    if &head[..8] != MAGIC {
        return Err(load(StateError::NotAState));
    }
    let version = u32::from_le_bytes(head[8..12].try_into().unwrap_or_default());
    if version != STATE_VERSION {
        return Err(load(StateError::Version(version)));
    }
    let hlen = u32::from_le_bytes(head[12..16].try_into().unwrap_or_default()) as u64;
    if hlen > MAX_HEADER as u64 || 16 + hlen > size {
        return Err(load(StateError::HeaderTruncated));
    }
    let mut bytes = head.to_vec();
    bytes.resize(16 + hlen as usize, 0);
    f.read_exact(&mut bytes[16..]).map_err(|e| load(e.into()))?;
    let header: Header =
        serde_json::from_slice(&bytes[16..]).map_err(|e| load(StateError::Header(e)))?;
    let payload = size - 16 - hlen;
    if payload != header.payload_bytes {
        return Err(load(StateError::PayloadSize {
            got: payload as usize,
            want: header.payload_bytes,
        }));
    }
    bytes
        .try_reserve_exact(payload as usize)
        .map_err(|e| load(std::io::Error::new(std::io::ErrorKind::OutOfMemory, e).into()))?;
    f.take(payload)
        .read_to_end(&mut bytes)
        .map_err(|e| load(e.into()))?;
    if bytes.len() as u64 != size {
        return Err(load(StateError::Truncated));
    }
    Ok(bytes)
}

/// Where a run starts: a fresh session over the prompt, or a loaded state whose last token
/// (generated, not consumed yet) and then the prompt are fed first.
pub struct Start {
    pub session: Session,
    /// Tokens the session has consumed.
    pub history: Vec<u32>,
    /// The sampler's first step number.
    pub first_step: usize,
    /// Tokens to feed first.
    pub prompt: Vec<u32>,
}

impl Start {
    /// Begin from `load` (path, fingerprint) when given, else from nothing.
    pub fn new<W: Weights>(
        model: &Model<W>,
        load: Option<(&Path, &str)>,
        prompt: &[u32],
    ) -> Result<Start, StateError> {
        let Some((path, fp)) = load else {
            return Ok(Start {
                session: model.new_session(),
                history: Vec::new(),
                first_step: 0,
                prompt: prompt.to_vec(),
            });
        };
        let mut saved = self::load(path, fp, model)?;
        let last = saved
            .tokens
            .pop()
            .ok_or_else(|| StateError::load(path)(StateError::NoTokens))?;
        let mut p = vec![last];
        p.extend_from_slice(prompt);
        Ok(Start {
            session: saved.session,
            history: saved.tokens,
            first_step: saved.steps as usize,
            prompt: p,
        })
    }

    /// Save the session after the loop generated `generated` from this start.
    pub fn save(&self, path: &Path, fp: &str, generated: &[u32]) -> Result<(), StateError> {
        if generated.is_empty() {
            return Err(StateError::save(path)(StateError::NothingGenerated));
        }
        let mut tokens = self.history.clone();
        tokens.extend_from_slice(&self.prompt);
        tokens.extend_from_slice(generated);
        save(
            path,
            fp,
            &tokens,
            (self.first_step + generated.len()) as u64,
            &self.session,
        )
    }
}

/// `k3-orch chat`'s `/save`: the state-file bytes of the state kept in `cache` whose key is
/// the longest proper prefix of `conversation` (the conversation so far, as the next turn's
/// prompt starts), and how many tokens it consumed. Its recorded tokens are the key plus
/// the conversation's next token. None kept (prefix reuse off, no turn yet): an error.
pub fn encode_prefix(
    cache: &mut PrefixCache,
    conversation: &[u32],
    fingerprint: &str,
) -> Result<(Vec<u8>, usize), StateError> {
    let (n, session) = cache.lookup(conversation).ok_or(StateError::NoneKept)?;
    let bytes = encode(fingerprint, &conversation[..n + 1], 0, &session)?;
    Ok((bytes, n))
}

/// `k3-orch chat`'s `/load`: check a state file's bytes (version, checksum, model) and
/// decode them for `model`; its tokens must start `conversation` (the loaded one). Returns
/// the key (the tokens the session consumed) and the session, for the prefix cache.
pub fn decode_prefix<W: Weights>(
    bytes: &[u8],
    fingerprint: &str,
    model: &Model<W>,
    conversation: &[u32],
) -> Result<(Vec<u32>, Session), StateError> {
    let (_, payload) = check(bytes, fingerprint)?;
    let mut saved = decode(payload, model)?;
    if !conversation.starts_with(&saved.tokens) {
        return Err(StateError::OtherConversation {
            state: saved.tokens.len(),
            conversation: conversation.len(),
        });
    }
    saved.tokens.pop();
    Ok((saved.tokens, saved.session))
}
