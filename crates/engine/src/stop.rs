//! Stop conditions on streamed text: stop strings are never emitted, and text that might be the
//! beginning of a stop string is held back until it is known not to be.

/// Tracks generated text against a set of stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopChecker {
    stops: Vec<String>,
    pending: String,
    stopped: bool,
}

impl StopChecker {
    /// A checker for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> StopChecker {
        StopChecker {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ..Default::default()
        }
    }

    /// Feed newly decoded text; returns the text that is safe to emit and whether a stop string
    /// was hit (in which case nothing after it is ever emitted).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.pending.push_str(text);
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = hit {
            self.stopped = true;
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Hold back the longest suffix of `pending` that is a proper prefix of a stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    hold = hold.max(i);
                }
            }
        }
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// End of generation without a stop string: release the held-back text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_partial_and_cuts_at_stop() {
        let mut s = StopChecker::new(&["</end>".to_string(), "STOP".to_string()]);
        assert_eq!(s.push("hello </"), ("hello ".to_string(), false));
        assert_eq!(s.push("e"), (String::new(), false));
        assert_eq!(s.push("x> more S"), ("</ex> more ".to_string(), false));
        assert_eq!(s.push("TOP and"), (String::new(), true));
        assert_eq!(s.push("later"), (String::new(), true));
    }

    #[test]
    fn finish_releases_pending_and_multibyte_is_safe() {
        let mut s = StopChecker::new(&["éé".to_string()]);
        assert_eq!(s.push("aé"), ("a".to_string(), false));
        assert_eq!(s.finish(), "é");
        let mut s = StopChecker::new(&[]);
        assert_eq!(s.push("x"), ("x".to_string(), false));
    }

    #[test]
    fn stop_inside_one_chunk() {
        let mut s = StopChecker::new(&["\n\n".to_string()]);
        assert_eq!(s.push("line\n\nnext"), ("line".to_string(), true));
    }
}
