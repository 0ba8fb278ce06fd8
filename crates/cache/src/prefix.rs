//! The prefix cache: KV blocks (and recurrent-state checkpoints) of finished and running
//! sequences, kept in a tree keyed by token content so that any later sequence with the same
//! prefix reuses them instead of recomputing.
//!
//! **Tree.** Each node is one KV block's worth of tokens (`1..=block_size`) following its
//! parent's; the root is the empty prefix. Only full-block nodes have children; a shorter
//! node is the tail of some sequence (a prompt or generation end). A node's identity is a
//! chained 128-bit hash of its parent's hash and its tokens, salted with a [`fingerprint`]
//! of the model and the cache layout; tokens are also stored and compared on every lookup,
//! so a hash collision can never produce a wrong hit.
//!
//! **Blocks.** A node holds its KV block by reference ([`KvCache::retain_block`]); a slot
//! that reuses it holds another reference, and the first write into a shared block copies it
//! (copy on write in [`KvCache::prepare`]), so a match that ends inside a block (divergence
//! inside a block) reuses the matching rows and copies the block before writing the rest.
//!
//! **Recurrent checkpoints.** For models with recurrent layers a node may carry a snapshot
//! of the conv and recurrent states after its last token. A hybrid model can only resume
//! where a snapshot exists, so a hit resumes from the deepest checkpoint at or below the
//! matched prefix. Snapshots have their own memory budget (least recently used first out).
//!
//! **Eviction.** When the KV pool runs dry the least recently used node whose block no
//! running sequence holds gives its block back. With a disk tier its block (and snapshot)
//! go to a file first and the node stays in the tree, coming back on a later hit, also after
//! a restart (`crate::disk`); without one only leaves are evicted (a node without KV would
//! make its subtree unreachable).

use std::collections::HashMap;
use std::sync::Arc;

use crate::{CacheLayout, KvCache, RecurrentSnapshot};

use crate::disk::{Disk, Kind, NodeKey, Scanned};

const ROOT: usize = 0;

fn mix64(mut h: u64, x: u64) -> u64 {
    h ^= x;
    h = h.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^= h >> 29;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^ (h >> 32)
}

/// Chain hash of a node: its parent's hash and its tokens.
fn chain(parent: u128, tokens: &[u32]) -> u128 {
    let mut a = (parent as u64) ^ 0x243f_6a88_85a3_08d3;
    let mut b = ((parent >> 64) as u64) ^ 0x1319_8a2e_0370_7344;
    a = mix64(a, tokens.len() as u64);
    b = mix64(b, !(tokens.len() as u64));
    for &t in tokens {
        a = mix64(a, t as u64);
        b = mix64(b, ((t as u64) << 17) | 0x5bd1);
    }
    ((b as u128) << 64) | a as u128
}

/// Fingerprint of what cached data depends on: the model (`model_id`, e.g. a hash of the
/// file's size and first bytes, plus its architecture, vocabulary and layout) and the cache layout (element type, block
/// size). Cache files with another fingerprint are never used.
pub fn fingerprint(
    model_id: &str,
    arch: &str,
    n_vocab: usize,
    layout: &CacheLayout,
    kv_type: &str,
    block_size: usize,
) -> u128 {
    let desc = format!(
        "kapitsa-prefix-v1|{model_id}|{arch}|{n_vocab}|{:?}|{}|{}|{kv_type}|{block_size}",
        layout.layers, layout.n_head_kv, layout.head_dim
    );
    let words: Vec<u32> = desc.bytes().map(u32::from).collect();
    chain(0x006b_6170_6974_7361, &words)
}

#[derive(Debug)]
struct Node {
    parent: usize,
    children: Vec<usize>,
    tokens: Vec<u32>,
    start: usize,
    hash: u128,
    /// KV block held in memory.
    block: Option<u32>,
    /// A `.kv` file holds the block.
    kv_on_disk: bool,
    /// States after the last token, in memory.
    state: Option<Arc<RecurrentSnapshot>>,
    /// A `.st` file holds the states.
    state_on_disk: bool,
    last_used: u64,
}

impl Node {
    fn end(&self) -> usize {
        self.start + self.tokens.len()
    }
    fn has_kv(&self) -> bool {
        self.block.is_some() || self.kv_on_disk
    }
    fn has_state(&self) -> bool {
        self.state.is_some() || self.state_on_disk
    }
}

/// Counters of the prefix cache (a snapshot).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Admissions that looked for a prefix.
    pub lookups: u64,
    /// Of those, admissions that reused at least one token.
    pub hits: u64,
    /// Prompt tokens not recomputed thanks to the cache.
    pub tokens_reused: u64,
    /// Nodes in the tree.
    pub nodes: usize,
    /// KV blocks the cache holds in memory.
    pub blocks_in_memory: usize,
    /// Bytes of recurrent snapshots in memory.
    pub state_bytes: usize,
    /// Bytes of cache files on disk.
    pub disk_bytes: u64,
    /// Cache files on disk.
    pub disk_files: usize,
    /// Blocks and snapshots read back from disk.
    pub disk_loads: u64,
    /// Cache files found damaged or foreign and ignored.
    pub disk_rejected: u64,
}

/// Where a sequence can resume ([`PrefixCache::plan`]).
#[derive(Debug, Clone, Default)]
struct Plan {
    /// Tokens reused.
    len: usize,
    /// Nodes covering `0..len`, in order.
    nodes: Vec<usize>,
    /// Node whose snapshot gives the states at `len` (recurrent models).
    state: Option<usize>,
}

/// The prefix cache (see the module docs).
#[derive(Debug)]
pub struct PrefixCache {
    nodes: Vec<Option<Node>>,
    free_nodes: Vec<usize>,
    by_hash: HashMap<u128, usize>,
    bs: usize,
    recurrent: bool,
    tick: u64,
    state_budget: usize,
    disk: Option<Disk>,
    stats: PrefixStats,
}

/// Settings of a [`PrefixCache`].
#[derive(Debug, Clone)]
pub struct PrefixConfig {
    /// Identity of the model and layout ([`fingerprint`]).
    pub fingerprint: u128,
    /// Most bytes of recurrent snapshots kept in memory.
    pub state_budget: usize,
    /// Disk tier: folder and size budget in bytes.
    pub disk: Option<(std::path::PathBuf, u64)>,
}

impl PrefixCache {
    /// An empty cache for `kv`'s layout, or the one found on disk.
    pub fn new(kv: &KvCache, cfg: &PrefixConfig) -> std::io::Result<PrefixCache> {
        let root = Node {
            parent: ROOT,
            children: Vec::new(),
            tokens: Vec::new(),
            start: 0,
            hash: cfg.fingerprint,
            block: None,
            kv_on_disk: false,
            state: None,
            state_on_disk: false,
            last_used: 0,
        };
        let mut pc = PrefixCache {
            nodes: vec![Some(root)],
            free_nodes: Vec::new(),
            by_hash: HashMap::from([(cfg.fingerprint, ROOT)]),
            bs: kv.block_size(),
            recurrent: kv.has_recurrent(),
            tick: 0,
            state_budget: cfg.state_budget,
            disk: None,
            stats: PrefixStats::default(),
        };
        if let Some((dir, budget)) = &cfg.disk {
            let (disk, found) = Disk::open(dir, cfg.fingerprint, *budget)?;
            pc.disk = Some(disk);
            pc.adopt_files(found);
        }
        Ok(pc)
    }

    /// Rebuild the tree from the files of an earlier run: a `.kv` file whose parent is
    /// known (the root or another file) becomes a node; `.st` files attach to their node.
    /// Files that do not fit (orphans, inconsistent hashes) are deleted.
    fn adopt_files(&mut self, found: Vec<Scanned>) {
        let mut pending: Vec<NodeKey> = found
            .iter()
            .filter(|s| s.kind == Kind::Kv)
            .map(|s| s.key.clone())
            .collect();
        let mut dead: Vec<(u128, Kind)> = Vec::new();
        loop {
            let before = pending.len();
            let mut still = Vec::new();
            for k in std::mem::take(&mut pending) {
                let Some(&p) = self.by_hash.get(&k.parent) else {
                    still.push(k);
                    continue;
                };
                let pn = self.node(p);
                let ok = pn.end() == k.start
                    && (p == ROOT || pn.tokens.len() == self.bs)
                    && k.tokens.len() <= self.bs
                    && chain(k.parent, &k.tokens) == k.hash
                    && !self.by_hash.contains_key(&k.hash);
                if ok {
                    let id = self.new_node(p, k.tokens.clone(), None);
                    self.node_mut(id).kv_on_disk = true;
                } else {
                    dead.push((k.hash, Kind::Kv));
                }
            }
            pending = still;
            if pending.len() == before {
                break;
            }
        }
        dead.extend(pending.iter().map(|k| (k.hash, Kind::Kv)));
        for s in found.iter().filter(|s| s.kind == Kind::State) {
            match self.by_hash.get(&s.key.hash) {
                Some(&id) if self.node(id).tokens == s.key.tokens => {
                    self.node_mut(id).state_on_disk = true
                }
                _ => dead.push((s.key.hash, Kind::State)),
            }
        }
        if let Some(d) = &mut self.disk {
            for (h, k) in dead {
                d.remove(h, k);
                d.rejected += 1;
            }
        }
    }

    fn node(&self, id: usize) -> &Node {
        // Ids come from the tree's own links, which only name live nodes (a removed node is
        // unlinked from its parent and `by_hash` first).
        self.nodes[id].as_ref().expect("live node")
    }

    fn node_mut(&mut self, id: usize) -> &mut Node {
        // As in `node`.
        self.nodes[id].as_mut().expect("live node")
    }

    fn new_node(&mut self, parent: usize, tokens: Vec<u32>, block: Option<u32>) -> usize {
        let p = self.node(parent);
        let (start, hash) = (p.end(), chain(p.hash, &tokens));
        self.tick += 1;
        let n = Node {
            parent,
            children: Vec::new(),
            tokens,
            start,
            hash,
            block,
            kv_on_disk: false,
            state: None,
            state_on_disk: false,
            last_used: self.tick,
        };
        let id = match self.free_nodes.pop() {
            Some(i) => {
                self.nodes[i] = Some(n);
                i
            }
            None => {
                self.nodes.push(Some(n));
                self.nodes.len() - 1
            }
        };
        self.by_hash.insert(hash, id);
        self.node_mut(parent).children.push(id);
        id
    }

    /// Remove a node and its subtree, giving back blocks and files.
    fn remove_subtree(&mut self, kv: &mut KvCache, id: usize) {
        if id == ROOT {
            return;
        }
        let parent = self.node(id).parent;
        self.node_mut(parent).children.retain(|&c| c != id);
        let mut stack = vec![id];
        while let Some(i) = stack.pop() {
            let Some(n) = self.nodes[i].take() else {
                continue;
            };
            stack.extend(&n.children);
            if let Some(b) = n.block {
                kv.release_block(b);
            }
            if let Some(d) = &mut self.disk {
                d.remove(n.hash, Kind::Kv);
                d.remove(n.hash, Kind::State);
            }
            self.by_hash.remove(&n.hash);
            self.free_nodes.push(i);
        }
    }

    /// Where `tokens` can resume: the longest cached prefix (capped at `len - 1`: the last
    /// token is always computed for its logits); for recurrent models the deepest
    /// checkpoint within it.
    fn plan(&self, tokens: &[u32]) -> Plan {
        let cap = tokens.len().saturating_sub(1);
        let mut plan = Plan::default();
        let mut path: Vec<usize> = Vec::new();
        let mut best_state: Option<(usize, usize)> = None; // (path length, node)
        let (mut cur, mut pos) = (ROOT, 0);
        let mut kv_len = 0;
        while pos < cap {
            let want = &tokens[pos..(pos + self.bs).min(tokens.len())];
            let mut best: Option<(usize, usize)> = None; // (matched, child)
            for &c in &self.node(cur).children {
                let n = self.node(c);
                if !n.has_kv() {
                    continue;
                }
                let m = n
                    .tokens
                    .iter()
                    .zip(want)
                    .take_while(|(a, b)| a == b)
                    .count();
                if m == n.tokens.len() && n.has_state() && n.end() <= cap {
                    best_state = Some((path.len() + 1, c));
                }
                if m > 0 && best.is_none_or(|(bm, _)| m > bm) {
                    best = Some((m, c));
                }
            }
            let Some((m, c)) = best else { break };
            path.push(c);
            kv_len = (pos + m).min(cap);
            if m < self.bs || self.node(c).tokens.len() < self.bs {
                break;
            }
            pos += self.bs;
            cur = c;
        }
        if self.recurrent {
            if let Some((depth, node)) = best_state {
                path.truncate(depth - 1);
                path.push(node);
                plan.len = self.node(node).end();
                plan.nodes = path;
                plan.state = Some(node);
            }
        } else if kv_len > 0 {
            plan.len = kv_len;
            let keep = kv_len.div_ceil(self.bs);
            path.truncate(keep);
            plan.nodes = path;
        }
        plan
    }

    /// Tokens of `tokens` a new sequence would reuse.
    pub fn reusable(&self, tokens: &[u32]) -> usize {
        self.plan(tokens).len
    }

    /// Set `slot` up to resume `tokens` from the longest usable cached prefix: its table
    /// takes the prefix's blocks (read back from disk where needed) and, for recurrent
    /// models, its states the checkpoint's. Returns the tokens reused (0: start from
    /// scratch; the slot then holds nothing).
    pub fn attach(&mut self, kv: &mut KvCache, slot: usize, tokens: &[u32]) -> usize {
        let plan = self.plan(tokens);
        if plan.len == 0 {
            return 0;
        }
        let mut blocks = Vec::with_capacity(plan.nodes.len());
        for (i, &id) in plan.nodes.iter().enumerate() {
            match self.materialize(kv, id, &plan.nodes) {
                Some(b) => blocks.push(b),
                None => {
                    // Lost (damaged file or no memory): reuse what came before, if the
                    // model can resume there.
                    let len = if self.recurrent { 0 } else { i * self.bs };
                    return self.finish_attach(kv, slot, &blocks[..len / self.bs], len, None);
                }
            }
        }
        let state = match plan.state {
            Some(id) => match self.load_state(id) {
                Some(s) => Some(s),
                None => return self.finish_attach(kv, slot, &[], 0, None),
            },
            None => None,
        };
        self.touch_path(*plan.nodes.last().unwrap_or(&ROOT));
        self.finish_attach(kv, slot, &blocks, plan.len, state)
    }

    fn finish_attach(
        &mut self,
        kv: &mut KvCache,
        slot: usize,
        blocks: &[u32],
        len: usize,
        state: Option<Arc<RecurrentSnapshot>>,
    ) -> usize {
        let mut len = len;
        if let Some(s) = &state {
            if kv.restore_recurrent(slot, s).is_err() {
                len = 0;
            }
        }
        if len == 0 || kv.adopt(slot, &blocks[..len.div_ceil(self.bs)]).is_err() {
            kv.release(slot);
            return 0;
        }
        len
    }

    /// Count an admission that went ahead after [`PrefixCache::attach`] reused `reused`
    /// tokens (attempts that found no memory are not counted).
    pub fn record_admission(&mut self, reused: usize) {
        self.stats.lookups += 1;
        if reused > 0 {
            self.stats.hits += 1;
            self.stats.tokens_reused += reused as u64;
        }
    }

    /// Mark a node and its ancestors used now.
    fn touch_path(&mut self, mut id: usize) -> u64 {
        self.tick += 1;
        let t = self.tick;
        while id != ROOT {
            let n = self.node_mut(id);
            n.last_used = t;
            id = n.parent;
        }
        t
    }

    /// The node's KV block in memory, read back from disk if needed (`None`: lost).
    fn materialize(&mut self, kv: &mut KvCache, id: usize, pinned: &[usize]) -> Option<u32> {
        if let Some(b) = self.node(id).block {
            return Some(b);
        }
        let key = self.key(id);
        let bytes = self.disk.as_mut()?.read(Kind::Kv, &key).ok();
        let Some(bytes) = bytes else {
            self.remove_subtree(kv, id);
            return None;
        };
        let b = loop {
            if let Some(b) = kv.alloc_block() {
                break b;
            }
            if !self.evict_one(kv, pinned) {
                return None;
            }
        };
        if kv.import_block(b, key.tokens.len(), &bytes).is_err() {
            kv.release_block(b);
            self.remove_subtree(kv, id);
            return None;
        }
        self.stats.disk_loads += 1;
        self.node_mut(id).block = Some(b);
        Some(b)
    }

    fn load_state(&mut self, id: usize) -> Option<Arc<RecurrentSnapshot>> {
        if let Some(s) = &self.node(id).state {
            return Some(s.clone());
        }
        let key = self.key(id);
        let snap = self
            .disk
            .as_mut()?
            .read(Kind::State, &key)
            .ok()
            .and_then(|b| decode_state(&b));
        match snap {
            Some(s) => {
                let s = Arc::new(s);
                self.node_mut(id).state = Some(s.clone());
                self.stats.disk_loads += 1;
                self.trim_states(&[id]);
                Some(s)
            }
            None => {
                self.node_mut(id).state_on_disk = false;
                None
            }
        }
    }

    fn key(&self, id: usize) -> NodeKey {
        let n = self.node(id);
        NodeKey {
            hash: n.hash,
            parent: self.node(n.parent).hash,
            start: n.start,
            tokens: n.tokens.clone(),
        }
    }

    /// Record the first `tokens.len()` positions of `slot` (its KV blocks, and `state`, the
    /// states after the last token, for recurrent models). Blocks already cached under the
    /// same tokens are kept as they are; the slot's blocks are shared, not copied.
    pub fn insert(
        &mut self,
        kv: &mut KvCache,
        slot: usize,
        tokens: &[u32],
        state: Option<RecurrentSnapshot>,
    ) {
        let n = tokens.len();
        let table = kv.table(slot).to_vec();
        if n == 0 || table.len() < n.div_ceil(self.bs) {
            return;
        }
        let mut cur = ROOT;
        for (i, t) in tokens.chunks(self.bs).enumerate() {
            let existing = self
                .node(cur)
                .children
                .iter()
                .copied()
                .find(|&c| self.node(c).tokens == t);
            cur = match existing {
                Some(c) => {
                    if self.node(c).block.is_none() {
                        kv.retain_block(table[i]);
                        self.node_mut(c).block = Some(table[i]);
                    }
                    c
                }
                None => {
                    kv.retain_block(table[i]);
                    self.new_node(cur, t.to_vec(), Some(table[i]))
                }
            };
        }
        self.touch_path(cur);
        if let Some(s) = state.filter(|s| s.pos == n && self.recurrent) {
            if self.node(cur).state.is_none() {
                self.node_mut(cur).state = Some(Arc::new(s));
                self.trim_states(&[cur]);
            }
        }
    }

    /// Keep the snapshots in memory within budget (oldest to disk or dropped).
    fn trim_states(&mut self, keep: &[usize]) {
        loop {
            let used: usize = self.state_bytes();
            if used <= self.state_budget {
                return;
            }
            let victim = self
                .nodes
                .iter()
                .enumerate()
                .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
                .filter(|(i, n)| n.state.is_some() && !keep.contains(i))
                .min_by_key(|(_, n)| n.last_used)
                .map(|(i, _)| i);
            let Some(v) = victim else { return };
            self.spill_state(v);
            self.node_mut(v).state = None;
        }
    }

    fn spill_state(&mut self, id: usize) {
        let key = self.key(id);
        let n = self.node(id);
        if n.state_on_disk {
            return;
        }
        let Some(s) = n.state.clone() else { return };
        let Some(d) = &mut self.disk else { return };
        if let Ok(gone) = d.write(Kind::State, &key, &encode_state(&s), &[key.hash]) {
            self.node_mut(id).state_on_disk = true;
            self.forget_files(gone);
        }
    }

    /// The disk tier deleted these files to stay within budget: update the nodes.
    fn forget_files(&mut self, gone: Vec<(u128, Kind)>) {
        for (h, k) in gone {
            let Some(&id) = self.by_hash.get(&h) else {
                continue;
            };
            let n = self.node_mut(id);
            match k {
                Kind::Kv => n.kv_on_disk = false,
                Kind::State => n.state_on_disk = false,
            }
            // A node without KV anywhere is dead, and so is its subtree; it is removed at
            // the next eviction pass (no KvCache at hand here), and never matched before
            // (`has_kv` is false).
        }
    }

    fn state_bytes(&self) -> usize {
        self.nodes
            .iter()
            .flatten()
            .filter_map(|n| n.state.as_ref())
            .map(|s| s.size_bytes())
            .sum()
    }

    /// Give one KV block back to the pool: the least recently used node whose block no
    /// running sequence holds (spilled to disk first when there is a disk tier). `false`
    /// when there is nothing to evict.
    pub fn evict_one(&mut self, kv: &mut KvCache, pinned: &[usize]) -> bool {
        // Dead nodes first (their files were deleted to respect the disk budget).
        let dead: Vec<usize> = (1..self.nodes.len())
            .filter(|&i| self.nodes[i].as_ref().is_some_and(|n| !n.has_kv()))
            .collect();
        let free_before = kv.n_free_blocks();
        for i in dead {
            if self.nodes[i].is_some() {
                self.remove_subtree(kv, i);
            }
        }
        if kv.n_free_blocks() > free_before {
            return true;
        }
        let disk = self.disk.is_some();
        let victim = self
            .nodes
            .iter()
            .enumerate()
            .skip(1)
            .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
            .filter(|(i, n)| {
                n.block.is_some_and(|b| kv.block_refs(b) == 1)
                    && !pinned.contains(i)
                    && (disk || n.children.is_empty())
            })
            .min_by_key(|(_, n)| (n.last_used, std::cmp::Reverse(n.start)))
            .map(|(i, _)| i);
        let Some(v) = victim else { return false };
        if disk && !self.node(v).kv_on_disk {
            let key = self.key(v);
            let rows = key.tokens.len();
            // `victim` filtered on `block.is_some()`.
            let b = self.node(v).block.unwrap_or(0);
            let keep: Vec<u128> = pinned.iter().map(|&p| self.node(p).hash).collect();
            // A block that cannot be read back from the device is dropped, not spilled.
            let bytes = kv.export_block(b, rows).ok();
            if let (Some(d), Some(bytes)) = (&mut self.disk, bytes) {
                if let Ok(gone) = d.write(Kind::Kv, &key, &bytes, &keep) {
                    self.node_mut(v).kv_on_disk = true;
                    self.forget_files(gone);
                }
            }
            self.spill_state(v);
        }
        if let Some(b) = self.node_mut(v).block.take() {
            kv.release_block(b);
        }
        if !self.node(v).kv_on_disk {
            self.remove_subtree(kv, v);
        }
        true
    }

    /// Write every node and snapshot held only in memory to the disk tier (at shutdown, so
    /// that a restart finds them). Returns how many entries were written; no-op without a
    /// disk tier.
    pub fn persist(&mut self, kv: &KvCache) -> usize {
        if self.disk.is_none() {
            return 0;
        }
        // Parents before children (ascending start), recent last so the budget keeps them.
        let mut ids: Vec<usize> = (1..self.nodes.len())
            .filter(|&i| self.nodes[i].is_some())
            .collect();
        ids.sort_by_key(|&i| (self.node(i).last_used, self.node(i).start));
        let mut written = 0;
        for id in ids {
            if self.nodes[id].is_none() {
                continue;
            }
            let n = self.node(id);
            if let (Some(b), false) = (n.block, n.kv_on_disk) {
                let key = self.key(id);
                let bytes = kv.export_block(b, key.tokens.len()).ok();
                let keep = [key.hash, key.parent];
                if let (Some(d), Some(bytes)) = (&mut self.disk, bytes) {
                    if let Ok(gone) = d.write(Kind::Kv, &key, &bytes, &keep) {
                        self.node_mut(id).kv_on_disk = true;
                        self.forget_files(gone);
                        written += 1;
                    }
                }
            }
            if self.node(id).state.is_some() && !self.node(id).state_on_disk {
                self.spill_state(id);
                written += usize::from(self.node(id).state_on_disk);
            }
        }
        written
    }

    /// Drop everything held in memory (blocks and snapshots); disk files stay.
    pub fn clear_memory(&mut self, kv: &mut KvCache) {
        while self.evict_one(kv, &[]) {}
    }

    /// Counters.
    pub fn stats(&self) -> PrefixStats {
        let mut s = self.stats;
        s.nodes = self.nodes.iter().flatten().count() - 1;
        s.blocks_in_memory = self
            .nodes
            .iter()
            .flatten()
            .filter(|n| n.block.is_some())
            .count();
        s.state_bytes = self.state_bytes();
        if let Some(d) = &self.disk {
            s.disk_bytes = d.used();
            s.disk_files = d.n_files();
            s.disk_rejected = d.rejected;
        }
        s
    }

    /// Whether a disk tier is attached.
    pub fn has_disk(&self) -> bool {
        self.disk.is_some()
    }
}

/// Snapshot bytes: pos u64, n_layers u32, per layer conv len u64, state len u64, f32s.
fn encode_state(s: &RecurrentSnapshot) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + s.size_bytes() + 16 * s.layers.len());
    out.extend((s.pos as u64).to_le_bytes());
    out.extend((s.layers.len() as u32).to_le_bytes());
    for (c, st) in &s.layers {
        out.extend((c.len() as u64).to_le_bytes());
        out.extend((st.len() as u64).to_le_bytes());
        for x in c.iter().chain(st) {
            out.extend(x.to_le_bytes());
        }
    }
    out
}

fn decode_state(b: &[u8]) -> Option<RecurrentSnapshot> {
    let mut r = b;
    let mut take = |n: usize| -> Option<&[u8]> {
        if r.len() < n {
            return None;
        }
        let (a, rest) = r.split_at(n);
        r = rest;
        Some(a)
    };
    let u64_ = |x: &[u8]| u64::from_le_bytes(x.try_into().unwrap_or([0; 8]));
    let pos = usize::try_from(u64_(take(8)?)).ok()?;
    let n = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
    let mut layers = Vec::with_capacity(n.min(1024));
    for _ in 0..n {
        let c = usize::try_from(u64_(take(8)?)).ok()?;
        let s = usize::try_from(u64_(take(8)?)).ok()?;
        let floats = |bytes: &[u8]| -> Vec<f32> {
            bytes
                .chunks_exact(4)
                .map(|q| f32::from_le_bytes([q[0], q[1], q[2], q[3]]))
                .collect()
        };
        let cv = floats(take(c.checked_mul(4)?)?);
        let sv = floats(take(s.checked_mul(4)?)?);
        layers.push((cv, sv));
    }
    if !r.is_empty() {
        return None;
    }
    Some(RecurrentSnapshot { pos, layers })
}
