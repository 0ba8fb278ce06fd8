//! The n-gram / suffix proposer: find where the sequence's last tokens occurred before, and
//! propose what followed them.
//!
//! Two places are searched:
//! - the sequence itself (prompt and output: "prompt lookup"), by [`lookup`]: every earlier
//!   occurrence of the last token, extended backwards, the longest match winning (the most
//!   recent among equals);
//! - recent requests, by a server-wide [`SuffixIndex`] (SuffixDecoding-style): finished
//!   requests' tokens, indexed by their [`KEY`]-token windows.
//!
//! A match of `L` tokens is worth up to `2 L` proposals ([`super::SpecState::ngram_len`]).
//! Matches shorter than [`MIN_MATCH`] are ignored.

use std::collections::{HashMap, VecDeque};

/// Shortest match that proposes anything.
pub const MIN_MATCH: usize = 2;
/// Matches are measured up to this length (longer ones count as this long).
pub const MAX_MATCH: usize = 32;
/// Tokens in a [`SuffixIndex`] key.
pub const KEY: usize = 3;
/// Occurrences kept per key in a [`SuffixIndex`] (the most recent).
const PER_KEY: usize = 16;

/// A match: the tokens that followed it (up to the requested count) and its length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Tokens after the matched occurrence.
    pub next: Vec<u32>,
    /// Matched tokens (the sequence's last `len` tokens occurred there).
    pub len: usize,
}

/// Backward match length of `hist[..=i]` against the end of `hist` (capped at
/// [`MAX_MATCH`] and at `i + 1`).
fn match_len(a: &[u32], i: usize, tail: &[u32]) -> usize {
    a[..=i]
        .iter()
        .rev()
        .zip(tail.iter().rev())
        .take(MAX_MATCH)
        .take_while(|(x, y)| x == y)
        .count()
}

/// The longest earlier occurrence of `hist`'s last tokens inside `hist` (module docs), with up
/// to `max` tokens that followed it. `None` when no match of [`MIN_MATCH`] tokens exists.
pub fn lookup(hist: &[u32], max: usize) -> Option<Found> {
    let n = hist.len();
    if n < MIN_MATCH + 1 || max == 0 {
        return None;
    }
    let last = hist[n - 1];
    let mut best: Option<(usize, usize)> = None; // (len, i)
    for i in (0..n - 1).rev() {
        if hist[i] != last {
            continue;
        }
        let l = match_len(hist, i, hist);
        if l >= MIN_MATCH && best.is_none_or(|(bl, _)| l > bl) {
            best = Some((l, i));
            if l == MAX_MATCH {
                break;
            }
        }
    }
    let (len, i) = best?;
    let next: Vec<u32> = hist[i + 1..].iter().take(max).copied().collect();
    (!next.is_empty()).then_some(Found { next, len })
}

/// Recent requests' tokens, searchable by their last [`KEY`] tokens (module docs). Keeps
/// whole documents, oldest dropped first once more than `capacity` tokens are held.
#[derive(Debug)]
pub struct SuffixIndex {
    docs: VecDeque<(u64, Vec<u32>)>,
    next_id: u64,
    held: usize,
    capacity: usize,
    /// Key -> (document id, position of the key's last token), most recent last.
    map: HashMap<[u32; KEY], VecDeque<(u64, u32)>>,
}

impl SuffixIndex {
    /// An empty index holding up to `capacity` tokens.
    pub fn new(capacity: usize) -> SuffixIndex {
        SuffixIndex {
            docs: VecDeque::new(),
            next_id: 0,
            held: 0,
            capacity,
            map: HashMap::new(),
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.held
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.held == 0
    }

    /// Add a finished request's tokens (prompt and output).
    pub fn insert(&mut self, tokens: &[u32]) {
        if tokens.len() <= KEY || tokens.len() > self.capacity {
            return;
        }
        while self.held + tokens.len() > self.capacity {
            self.pop_oldest();
        }
        let id = self.next_id;
        self.next_id += 1;
        for (p, w) in tokens.windows(KEY).enumerate() {
            let key = [w[0], w[1], w[2]];
            let e = self.map.entry(key).or_default();
            if e.len() == PER_KEY {
                e.pop_front();
            }
            e.push_back((id, (p + KEY - 1) as u32));
        }
        self.held += tokens.len();
        self.docs.push_back((id, tokens.to_vec()));
    }

    fn pop_oldest(&mut self) {
        let Some((id, toks)) = self.docs.pop_front() else {
            return;
        };
        self.held -= toks.len();
        for w in toks.windows(KEY) {
            let key = [w[0], w[1], w[2]];
            if let Some(e) = self.map.get_mut(&key) {
                e.retain(|&(d, _)| d != id);
                if e.is_empty() {
                    self.map.remove(&key);
                }
            }
        }
    }

    fn doc(&self, id: u64) -> Option<&[u32]> {
        // Documents are in id order: find by binary search.
        let i = self.docs.binary_search_by_key(&id, |(d, _)| *d).ok()?;
        Some(&self.docs[i].1)
    }

    /// The longest occurrence of `tail`'s last tokens in the held documents, with up to
    /// `max` tokens that followed it. `None` without a match of at least [`KEY`] tokens
    /// followed by something.
    pub fn lookup(&self, tail: &[u32], max: usize) -> Option<Found> {
        if tail.len() < KEY || max == 0 {
            return None;
        }
        let n = tail.len();
        let key = [tail[n - 3], tail[n - 2], tail[n - 1]];
        let mut best: Option<Found> = None;
        for &(id, pos) in self.map.get(&key)?.iter().rev() {
            let Some(doc) = self.doc(id) else { continue };
            let pos = pos as usize;
            if pos + 1 >= doc.len() {
                continue;
            }
            let l = match_len(doc, pos, tail);
            if best.as_ref().is_none_or(|b| l > b.len) {
                best = Some(Found {
                    next: doc[pos + 1..].iter().take(max).copied().collect(),
                    len: l,
                });
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_history_longest_match_wins() {
        // ... 1 2 3 [9] ... 7 2 3 [8] ... 1 2 3  -> the first (match 3) beats the second (2)
        let h = [1, 2, 3, 9, 5, 7, 2, 3, 8, 6, 1, 2, 3];
        let f = lookup(&h, 4).unwrap();
        assert_eq!(f.len, 3);
        assert_eq!(f.next, vec![9, 5, 7, 2]);
        // the most recent of equal matches
        let h = [5, 1, 4, 0, 5, 1, 6, 0, 5, 1];
        assert_eq!(lookup(&h, 1).unwrap().next, vec![6]);
        // nothing repeats
        assert_eq!(lookup(&[1, 2, 3, 4], 4), None);
        // a single repeated token is too short a match
        assert_eq!(lookup(&[7, 1, 8, 1], 4), None);
        assert_eq!(lookup(&h, 0), None);
    }

    #[test]
    fn suffix_index_finds_and_forgets() {
        let mut ix = SuffixIndex::new(20);
        ix.insert(&[10, 11, 12, 13, 14, 15]);
        ix.insert(&[20, 11, 12, 13, 16]);
        // tail "11 12 13": both match 3; the longer backward match (10 11 12 13) wins
        let f = ix.lookup(&[0, 10, 11, 12, 13], 8).unwrap();
        assert_eq!((f.len, f.next), (4, vec![14, 15]));
        let f = ix.lookup(&[20, 11, 12, 13], 8).unwrap();
        assert_eq!(f.next, vec![16]);
        assert_eq!(ix.lookup(&[1, 2, 3], 8), None);
        assert_eq!(ix.len(), 11);
        // capacity: the oldest document goes
        ix.insert(&[30, 31, 32, 33, 34, 35, 36, 37, 38, 39]);
        assert_eq!(ix.len(), 15);
        assert_eq!(ix.lookup(&[10, 11, 12, 13], 8).unwrap().next, vec![16]);
        // too long for the index at all
        ix.insert(&[1; 21]);
        assert_eq!(ix.len(), 15);
    }
}
