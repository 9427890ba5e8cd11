//! Request priority: which lane of the queue a request waits in.

use std::fmt;
use std::str::FromStr;

/// How urgently a request wants its vectors; each priority is one lane of the
/// queue with its own admission bounds.
///
/// Interactive queries use `High`, ordinary traffic `Normal` (the default),
/// bulk ingestion `Low`. Batches take lanes high > normal > low, with
/// an aging rule that bounds how long a lower lane can be passed over
/// (see [`crate::BatcherConfig::aging_batches`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Priority {
    /// Interactive queries: the next batch takes them first.
    High,
    /// Ordinary traffic.
    #[default]
    Normal,
    /// Bulk work, passed over while others wait (within aging).
    Low,
}

impl Priority {
    /// Every priority, most urgent first (the lanes' index order).
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Normal, Priority::Low];

    /// The lane index: 0 for high, 1 for normal, 2 for low.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The lowercase name, as in the `X-Priority` header and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }

    /// Maps the integer `priority` that vLLM (and OpenAI-style clients) send:
    /// lower values are served earlier and 0 is the default, so a negative
    /// value is `High`, 0 is `Normal` and a positive value is `Low`.
    pub fn from_vllm(value: i64) -> Self {
        match value {
            v if v < 0 => Priority::High,
            0 => Priority::Normal,
            _ => Priority::Low,
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The text was not `high`, `normal` or `low`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("priority must be high, normal or low, not {0:?}")]
pub struct ParsePriorityError(pub String);

impl FromStr for Priority {
    type Err = ParsePriorityError;

    /// Case-insensitive `high`, `normal` or `low`, surrounding spaces ignored.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        Priority::ALL
            .into_iter()
            .find(|p| t.eq_ignore_ascii_case(p.as_str()))
            .ok_or_else(|| ParsePriorityError(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_vllm_integers_map_to_lanes() {
        assert_eq!("HIGH".parse(), Ok(Priority::High));
        assert_eq!(" normal ".parse(), Ok(Priority::Normal));
        assert_eq!("low".parse(), Ok(Priority::Low));
        assert!("urgent".parse::<Priority>().is_err());
        assert_eq!(Priority::from_vllm(-5), Priority::High);
        assert_eq!(Priority::from_vllm(0), Priority::Normal);
        assert_eq!(Priority::from_vllm(10), Priority::Low);
        assert_eq!(Priority::default(), Priority::Normal);
        assert_eq!(Priority::ALL.map(Priority::index), [0, 1, 2]);
    }
}
