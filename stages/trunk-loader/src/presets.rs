//! Memory presets and budgets: `--preset NAME`, `--trunk-gb`, `--cache-gb`, `auto`.
//!
//! The preset table lives in `configs/presets.json` (compiled in; [`Presets::from_json`]
//! reads another copy). A preset is only a shorthand for the two budgets. GB here is 10^9
//! bytes, as in the seed's reports. The table carries no speed: what a preset costs per
//! token is k3's own projection (`k3-orch --list-presets`, from the orchestrator's
//! `project` tool), never the seed engine's measurements.
//!
//! `auto` spends memory the way the seed's measurements say pays: the trunk first, until it
//! is fully pinned (a GB given to the trunk removes about a GB of certain reads per token),
//! then the expert cache (which below ~36 GB of arena retains almost nothing on this model).

use serde::Deserialize;

/// The compiled-in `configs/presets.json`.
pub const PRESETS_JSON: &str = include_str!("../../../configs/presets.json");

/// Bytes in a GB (the seed's unit).
pub const GB: f64 = 1e9;

/// The two budgets the memory flags set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Budgets {
    /// `--trunk-gb`: pinned layers plus the streaming ring.
    pub trunk_bytes: u64,
    /// `--cache-gb`: the routed-expert arena.
    pub cache_bytes: u64,
}

impl Budgets {
    /// Budgets from GB figures.
    pub fn from_gb(trunk_gb: f64, cache_gb: f64) -> Budgets {
        Budgets {
            trunk_bytes: gb_to_bytes(trunk_gb),
            cache_bytes: gb_to_bytes(cache_gb),
        }
    }

    /// Both together.
    pub fn total(&self) -> u64 {
        self.trunk_bytes + self.cache_bytes
    }
}

/// `x` GB in bytes (negative and NaN give 0).
pub fn gb_to_bytes(x: f64) -> u64 {
    if x.is_finite() && x > 0.0 {
        (x * GB).round() as u64
    } else {
        0
    }
}

/// One preset.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Preset {
    pub name: String,
    pub trunk_gb: f64,
    pub cache_gb: f64,
    pub description: String,
    /// The doctor suggests this preset from this much MemAvailable (GB) up; `None`: never.
    pub min_available_gb: Option<f64>,
}

impl Preset {
    /// Its budgets.
    pub fn budgets(&self) -> Budgets {
        Budgets::from_gb(self.trunk_gb, self.cache_gb)
    }
}

/// The preset table.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Presets {
    pub format: String,
    pub note: String,
    pub presets: Vec<Preset>,
}

/// A preset table that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PresetsError {
    #[error("presets.json: {0}")]
    Json(#[source] serde_json::Error),
    #[error("presets.json: format {0:?}, expected \"k3-presets/1\"")]
    Format(String),
    /// Every problem found (duplicates, budgets, a listed `auto`).
    #[error("presets.json: {}", .0.join("; "))]
    Problems(Vec<String>),
}

impl Presets {
    /// The compiled-in table.
    pub fn builtin() -> Presets {
        Presets::from_json(PRESETS_JSON).expect("configs/presets.json is valid (tested)")
    }

    /// Parse a table, checking names are unique and budgets positive.
    pub fn from_json(text: &str) -> Result<Presets, PresetsError> {
        let p: Presets = serde_json::from_str(text).map_err(PresetsError::Json)?;
        if p.format != "k3-presets/1" {
            return Err(PresetsError::Format(p.format));
        }
        let mut problems = Vec::new();
        for (i, a) in p.presets.iter().enumerate() {
            if p.presets[..i].iter().any(|b| b.name == a.name) {
                problems.push(format!("preset {:?} is listed twice", a.name));
            }
            if !(a.trunk_gb > 0.0 && a.cache_gb > 0.0) {
                problems.push(format!("preset {:?}: budgets must be positive", a.name));
            }
            if a.name == "auto" {
                problems.push("\"auto\" is computed, not a table entry".into());
            }
        }
        if problems.is_empty() {
            Ok(p)
        } else {
            Err(PresetsError::Problems(problems))
        }
    }

    /// A preset by name (`auto` is not in the table: see [`auto`]).
    pub fn get(&self, name: &str) -> Option<&Preset> {
        self.presets.iter().find(|p| p.name == name)
    }

    /// Preset names, for error messages: "laptop, desktop, ..., auto".
    pub fn names(&self) -> String {
        let mut v: Vec<&str> = self.presets.iter().map(|p| p.name.as_str()).collect();
        v.push("auto");
        v.join(", ")
    }

    /// The bare preset table (budgets and descriptions; `k3-orch --list-presets` adds what
    /// k3's plan holds and its projected s/token).
    pub fn list_text(&self) -> String {
        let mut s = String::from("presets (trunk / expert-cache, in GB):\n");
        for p in &self.presets {
            let budgets = format!("{:.1} / {:.1}", p.trunk_gb, p.cache_gb);
            s.push_str(&format!(
                "  {:<12} {:>13}    {}\n",
                p.name, budgets, p.description
            ));
        }
        s.push_str(
            "  auto           from MemAvailable: the trunk first until fully pinned, then the cache\n",
        );
        s.push_str(&format!("\n{}\n", self.note));
        s.push_str("Run `k3-orch doctor MODEL_DIR` to see which one this machine fits.\n");
        s
    }

    /// The preset the doctor recommends for `mem_available` bytes, largest threshold first;
    /// `None` when the machine is below every threshold (it cannot run the model).
    pub fn for_available(&self, mem_available: u64) -> Option<&Preset> {
        let gb = mem_available as f64 / GB;
        self.presets
            .iter()
            .filter_map(|p| p.min_available_gb.map(|m| (m, p)))
            .filter(|(m, _)| gb >= *m)
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, p)| p)
    }
}

/// Split `spendable` bytes between trunk and cache: the trunk first, up to `trunk_total`
/// (every layer pinned), then the cache; the cache keeps at least one full batch of 16 slots
/// when `spendable` allows (one slot otherwise).
///
/// `spendable` is what the trunk and the cache may use together: MemAvailable minus the rest
/// of the memory plan (embed and lm_head, state, KV, buffers) and a margin; see
/// [`auto_from_meminfo`]. `trunk_total` is the pinned footprint of the whole trunk (sum of
/// its page-rounded runs), `expert_size` the bytes of one routed expert.
pub fn auto(spendable: u64, trunk_total: u64, expert_size: u64) -> Budgets {
    let slot = k3_io::slot_bytes_for(expert_size);
    let min_cache = if spendable >= trunk_total.saturating_add(16 * slot) || spendable >= 32 * slot
    {
        16 * slot
    } else {
        slot
    };
    let trunk = spendable.saturating_sub(min_cache).min(trunk_total);
    Budgets {
        trunk_bytes: trunk,
        cache_bytes: spendable - trunk,
    }
}

// MemAvailable capped by the memory cgroup, and the meminfo parser: one copy, in k3-io.
pub use k3_io::sysmem::{mem_available, parse_meminfo};

/// `auto` from this machine: 95% of what is available ([`mem_available`]: MemAvailable
/// capped by the memory cgroup; the memory plan refuses above that), minus `other_bytes`
/// (the rest of the plan), split by [`auto`].
pub fn auto_from_meminfo(other_bytes: u64, trunk_total: u64, expert_size: u64) -> Option<Budgets> {
    let avail = mem_available()?;
    let spendable = (avail as f64 * 0.95) as u64;
    Some(auto(
        spendable.saturating_sub(other_bytes),
        trunk_total,
        expert_size,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Figures transcribed from the seed's `--list-presets` and doctor thresholds.
    #[test]
    fn builtin_presets_are_the_seeds() {
        let p = Presets::builtin();
        let want = [
            ("laptop", 3.0, 1.0),
            ("desktop", 16.0, 10.0),
            ("workstation", 60.0, 30.0),
            ("server", 110.0, 13.0),
            ("max", 110.0, 109.0),
        ];
        assert_eq!(p.presets.len(), 5);
        for (name, t, c) in want {
            let x = p.get(name).unwrap();
            assert_eq!((x.trunk_gb, x.cache_gb), (t, c), "{name}");
        }
        assert_eq!(
            p.get("server").unwrap().budgets(),
            Budgets {
                trunk_bytes: 110_000_000_000,
                cache_bytes: 13_000_000_000
            }
        );
        let gb = |x: u64| x * 1_000_000_000;
        assert_eq!(p.for_available(gb(200)).unwrap().name, "server");
        assert_eq!(p.for_available(gb(192)).unwrap().name, "server");
        assert_eq!(p.for_available(gb(191)).unwrap().name, "workstation");
        assert_eq!(p.for_available(gb(96)).unwrap().name, "workstation");
        assert_eq!(p.for_available(gb(40)).unwrap().name, "desktop");
        assert_eq!(p.for_available(gb(10)).unwrap().name, "laptop");
        assert!(p.for_available(gb(9)).is_none());
        let text = p.list_text();
        assert!(text.contains("laptop"));
        assert!(text.contains("110.0 / 109.0"));
        assert!(text.contains("The floor. Runs, slowly."));
        assert!(text.contains("need --trunk <packed_dir>."));
        assert!(
            !text.contains("s/token"),
            "no speed in the table: the seed's were not k3's"
        );
        assert!(p.names().ends_with("max, auto"));
    }

    #[test]
    fn rejects_bad_tables() {
        assert!(Presets::from_json("{}").is_err());
        let dup = PRESETS_JSON.replace("\"desktop\"", "\"laptop\"");
        let e = Presets::from_json(&dup).unwrap_err();
        assert!(matches!(e, PresetsError::Problems(_)));
        assert!(e.to_string().contains("twice"), "{e}");
    }

    #[test]
    fn auto_feeds_the_trunk_first() {
        let e = 17_547_264u64;
        let slot = k3_io::slot_bytes_for(e);
        let trunk = 108_810_000_000u64;
        // Plenty: the whole trunk, the rest to the cache.
        let b = auto(200_000_000_000, trunk, e);
        assert_eq!(b.trunk_bytes, trunk);
        assert_eq!(b.total(), 200_000_000_000);
        // Less than the trunk: the trunk takes all but one batch of experts.
        let b = auto(50_000_000_000, trunk, e);
        assert_eq!(b.cache_bytes, 16 * slot);
        assert_eq!(b.total(), 50_000_000_000);
        // Tiny: one slot of cache.
        let b = auto(10 * slot, trunk, e);
        assert_eq!(b.cache_bytes, slot);
    }
}
