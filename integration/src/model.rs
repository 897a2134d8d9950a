//! The sequential model of the concurrency-against-a-model tests (issue 22),
//! pure Rust so that both of them use one copy: the engine's
//! `tests::model` (publishers as tasks in one engine) and the integration
//! test `reliability::publisher_processes_leave_the_history_a_sequential_model_predicts`
//! (publishers as separate processes, each through a real daemon's admin API).
//!
//! A race: publishers with random overlapping and disjoint changesets race on
//! one head; the history they leave is replayed on a sequential model of the
//! tree, which must equal the head exactly: every committed changeset once, in
//! the log's order, every rejected one absent, no update lost (a line edited by
//! a committed publish reads the last committed value, whatever merged around
//! it).
//!
//! The changesets are line edits of shared 16-line text files (so concurrent
//! edits of one file merge when their hunks are apart and conflict when they
//! touch), deletions and re-creations of shared files, and files only their
//! publisher writes (which always commit). Every value written is unique to its
//! publisher, so a rejected publisher's writes cannot hide in the result.
//!
//! Paths are relative to the directory the race runs in (`shared/f3.txt`,
//! `own/p17.txt`); a tree is the regular files below it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

/// Shared files.
pub const FILES: usize = 32;
/// Lines of a shared file.
pub const LINES: usize = 16;

/// A tree of text files: path → its lines (present files only).
pub type Tree = BTreeMap<String, Vec<String>>;

/// A xorshift generator; one stream per publisher.
pub struct Rng(u64);

impl Rng {
    /// Publisher `i`'s own stream (splitmix64 of the seed and `i`: distinct
    /// publishers never share a stream).
    pub fn for_publisher(seed: u64, i: usize) -> Rng {
        let mut z = seed.wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// True `percent` times in 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// The race's seed: `LAYERSTACK_MODEL_SEED`, or the clock (print it, so that a
/// failure can be replayed).
pub fn seed_from_env() -> u64 {
    std::env::var("LAYERSTACK_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
                | 1
        })
}

/// Shared file `k`.
pub fn shared(k: usize) -> String {
    format!("shared/f{k}.txt")
}

/// Publisher `i`'s own file.
pub fn own(i: usize) -> String {
    format!("own/p{i}.txt")
}

/// Lines as a file's bytes (each ended by a newline).
pub fn text(lines: &[String]) -> Vec<u8> {
    let mut s = String::new();
    for l in lines {
        s.push_str(l);
        s.push('\n');
    }
    s.into_bytes()
}

/// A file's lines.
///
/// # Panics
/// Not UTF-8 (the race writes only UTF-8).
pub fn lines_of(bytes: &[u8]) -> Vec<String> {
    String::from_utf8(bytes.to_vec())
        .expect("the race writes UTF-8 only")
        .lines()
        .map(str::to_string)
        .collect()
}

/// The tree the race starts from: every shared file, `f{k} line {l}`.
pub fn seed_tree() -> Tree {
    (0..FILES)
        .map(|k| {
            let lines = (0..LINES).map(|l| format!("f{k} line {l}")).collect();
            (shared(k), lines)
        })
        .collect()
}

/// One write of a changeset into a session's tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// Make or replace a regular file (its parents too).
    File(String, Vec<u8>),
    /// Delete a file that the session's base holds.
    Delete(String),
}

/// One publisher's changeset, as the model applies it.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Changeset {
    /// (shared file, line, new value) — the file existed in the session's base.
    pub edits: Vec<(usize, usize, String)>,
    /// Shared files deleted (existed in the base, not edited by this changeset).
    pub deletes: Vec<usize>,
    /// Shared files created (absent in the base), with their whole content.
    pub creates: Vec<(usize, Vec<String>)>,
    /// The publisher's own file, if it wrote one (content = its path's name).
    pub own: Option<String>,
}

impl Changeset {
    /// Draws publisher `i`'s changeset over `base`, the tree its session leased
    /// (only the shared files are looked at).
    pub fn draw(rng: &mut Rng, i: usize, base: &Tree) -> Changeset {
        let mut c = Changeset::default();
        let present: Vec<Option<&Vec<String>>> = (0..FILES).map(|k| base.get(&shared(k))).collect();
        let disjoint_only = rng.chance(10);
        if !disjoint_only {
            let mut edited = BTreeSet::new();
            for _ in 0..1 + rng.below(3) {
                let k = rng.below(FILES);
                match present[k] {
                    Some(_) => {
                        let line = rng.below(LINES);
                        c.edits
                            .push((k, line, format!("p{i} edits f{k} line {line}")));
                        edited.insert(k);
                    }
                    None if !c.creates.iter().any(|(ck, _)| *ck == k) => {
                        let lines = (0..LINES)
                            .map(|l| format!("p{i} creates f{k} line {l}"))
                            .collect();
                        c.creates.push((k, lines));
                    }
                    None => {}
                }
            }
            if rng.chance(6) {
                let k = rng.below(FILES);
                if present[k].is_some() && !edited.contains(&k) {
                    c.deletes.push(k);
                }
            }
        }
        if disjoint_only || rng.chance(20) {
            c.own = Some(own(i));
        }
        if !c.touches_shared() && c.own.is_none() {
            c.own = Some(own(i));
        }
        c
    }

    /// What the publisher writes into its session over `base` (the tree it
    /// was drawn over): each edited file whole, with its edits.
    ///
    /// # Panics
    /// `base` lacks a file the changeset edits.
    pub fn writes(&self, base: &Tree) -> Vec<Write> {
        let mut out = Vec::new();
        for (k, lines) in &self.creates {
            out.push(Write::File(shared(*k), text(lines)));
        }
        let mut edited: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for (k, line, v) in &self.edits {
            edited
                .entry(*k)
                .or_insert_with(|| base[&shared(*k)].clone())[*line] = v.clone();
        }
        for (k, lines) in &edited {
            out.push(Write::File(shared(*k), text(lines)));
        }
        for k in &self.deletes {
            out.push(Write::Delete(shared(*k)));
        }
        if let Some(path) = &self.own {
            out.push(Write::File(path.clone(), format!("{path}\n").into_bytes()));
        }
        out
    }

    /// The shared files it touches.
    pub fn files(&self) -> BTreeSet<usize> {
        let e = self.edits.iter().map(|(k, _, _)| *k);
        let c = self.creates.iter().map(|(k, _)| *k);
        e.chain(c).chain(self.deletes.iter().copied()).collect()
    }

    /// The shared files both it and `other` change differently: the files
    /// both touch, less those both delete. Deleting a file another changeset
    /// deleted too is the same change on both sides, which the gate publishes
    /// clean (ARCHITECTURE §7): neither a merge nor a conflict. Edits and
    /// creates never coincide (every line a publisher writes names it).
    pub fn clashes_with(&self, other: &Changeset) -> BTreeSet<usize> {
        let both_delete: BTreeSet<usize> = self
            .deletes
            .iter()
            .filter(|k| other.deletes.contains(k))
            .copied()
            .collect();
        let theirs = other.files();
        self.files()
            .into_iter()
            .filter(|k| theirs.contains(k) && !both_delete.contains(k))
            .collect()
    }

    /// Whether it touches a shared file (else it can never conflict).
    pub fn touches_shared(&self) -> bool {
        !(self.edits.is_empty() && self.creates.is_empty() && self.deletes.is_empty())
    }

    /// Applies it to the model's `tree`.
    ///
    /// # Errors
    /// It edits a file the tree lacks.
    pub fn apply(&self, tree: &mut Tree) -> Result<(), String> {
        for (k, lines) in &self.creates {
            tree.insert(shared(*k), lines.clone());
        }
        for (k, line, v) in &self.edits {
            let f = tree
                .get_mut(&shared(*k))
                .ok_or_else(|| format!("it edits f{k}, which the model lacks"))?;
            f[*line] = v.clone();
        }
        for k in &self.deletes {
            tree.remove(&shared(*k));
        }
        if let Some(path) = &self.own {
            tree.insert(path.clone(), vec![path.clone()]);
        }
        Ok(())
    }
}

/// How a publisher's publish ended, as far as the model cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Committed on the head as it was.
    Committed,
    /// Merged with what landed after its lease.
    Merged,
    /// Refused: a conflict.
    Rejected,
}

/// A race's publishers, by session id: their changesets and ends.
#[derive(Debug, Default)]
pub struct Race {
    pub changesets: HashMap<i64, Changeset>,
    pub ended: HashMap<i64, Ended>,
    /// Found by [`Race::replay`]: the deletes of each landed changeset whose
    /// file was already gone when it landed (another deleted it after its
    /// lease). They changed nothing, so they clash with nothing that follows.
    pub void_deletes: HashMap<i64, BTreeSet<usize>>,
}

impl Race {
    /// Records session `sid`'s changeset and end.
    ///
    /// # Errors
    /// The session is recorded twice, or a changeset touching no shared file
    /// was rejected.
    pub fn add(&mut self, sid: i64, c: Changeset, ended: Ended) -> Result<(), String> {
        if ended == Ended::Rejected && !c.touches_shared() {
            return Err(format!(
                "session {sid}: a changeset of its own file only was rejected: {c:?}"
            ));
        }
        if self.changesets.insert(sid, c).is_some() {
            return Err(format!("session {sid} published twice"));
        }
        self.ended.insert(sid, ended);
        Ok(())
    }

    /// Session `sid`'s changeset as it landed: less the deletes that
    /// changed nothing (after [`Race::replay`]).
    fn as_landed(&self, sid: i64) -> Changeset {
        let mut c = self.changesets[&sid].clone();
        if let Some(void) = self.void_deletes.get(&sid) {
            c.deletes.retain(|f| !void.contains(f));
        }
        c
    }

    fn with(&self, e: impl Fn(Ended) -> bool) -> BTreeSet<i64> {
        self.ended
            .iter()
            .filter(|(_, x)| e(**x))
            .map(|(s, _)| *s)
            .collect()
    }

    /// Sessions that committed (merged or not).
    pub fn committed(&self) -> BTreeSet<i64> {
        self.with(|e| e != Ended::Rejected)
    }

    /// Sessions that merged.
    pub fn merged(&self) -> BTreeSet<i64> {
        self.with(|e| e == Ended::Merged)
    }

    /// Sessions that were rejected.
    pub fn rejected(&self) -> BTreeSet<i64> {
        self.with(|e| e == Ended::Rejected)
    }

    /// Checks `order` — the race's sessions as the branch log lists their
    /// layers, oldest first (others' filtered out) — and replays it on the
    /// model from `seed`: every committed changeset exactly once, no rejected
    /// one. Calls `state(k, tree)` with the model's tree after the first `k`
    /// of them (`k = 0`: `seed`) and answers the last. Records the deletes
    /// that changed nothing in [`Race::void_deletes`].
    ///
    /// # Errors
    /// A session appears twice, the log's sessions are not the committed
    /// ones, a changeset does not apply.
    pub fn replay(
        &mut self,
        order: &[i64],
        seed: &Tree,
        mut state: impl FnMut(usize, &Tree),
    ) -> Result<Tree, String> {
        let once: BTreeSet<i64> = order.iter().copied().collect();
        if once.len() != order.len() {
            return Err(format!("a changeset appears twice in the log: {order:?}"));
        }
        let committed = self.committed();
        if once != committed {
            return Err(format!(
                "the log's changesets are not the committed ones: in the log only {:?}, committed but not in the log {:?}",
                once.difference(&committed).collect::<Vec<_>>(),
                committed.difference(&once).collect::<Vec<_>>()
            ));
        }
        let mut tree = seed.clone();
        state(0, &tree);
        self.void_deletes.clear();
        for (k, sid) in order.iter().enumerate() {
            let c = &self.changesets[sid];
            let void: BTreeSet<usize> = c
                .deletes
                .iter()
                .filter(|f| !tree.contains_key(&shared(**f)))
                .copied()
                .collect();
            if !void.is_empty() {
                self.void_deletes.insert(*sid, void);
            }
            c.apply(&mut tree)
                .map_err(|e| format!("session {sid}: {e}"))?;
            state(k + 1, &tree);
        }
        Ok(tree)
    }

    /// No false conflict: each rejected changeset clashes with one that
    /// ([`Changeset::clashes_with`]) landed after the manifest it leased. `landed_after(rejected, k)`: whether
    /// `order[k]` landed after `rejected`'s lease.
    ///
    /// # Errors
    /// The first rejection nothing explains.
    pub fn check_rejections(
        &self,
        order: &[i64],
        landed_after: impl Fn(i64, usize) -> bool,
    ) -> Result<(), String> {
        for sid in self.rejected() {
            let mine = &self.changesets[&sid];
            let raced = order.iter().enumerate().any(|(k, other)| {
                landed_after(sid, k) && !mine.clashes_with(&self.changesets[other]).is_empty()
            });
            if !raced {
                return Err(format!(
                    "session {sid} was rejected although nothing that landed after its lease touched its files: {:?}",
                    self.changesets[&sid]
                ));
            }
        }
        Ok(())
    }

    /// Outcome kinds agree with the history: a merged changeset clashes
    /// ([`Changeset::clashes_with`]) with one that landed between its lease and itself (a merge needs both
    /// sides to have changed a path); a committed one clashes with none (else the
    /// gate would have had to merge it, or refuse it). `may_follow(sid, k)`:
    /// `order[k]` may have landed after `sid`'s lease; `surely_follows(sid, k)`:
    /// it surely did (the same answer when the lease is known exactly).
    ///
    /// # Errors
    /// The first outcome the history contradicts.
    pub fn check_outcomes(
        &self,
        order: &[i64],
        may_follow: impl Fn(i64, usize) -> bool,
        surely_follows: impl Fn(i64, usize) -> bool,
    ) -> Result<(), String> {
        for (at, sid) in order.iter().enumerate() {
            let mine = &self.changesets[sid];
            // The first changeset before it that `follows` and clashes with
            // it: as landed (its void deletes dropped) when `landed`.
            let overlap = |follows: &dyn Fn(i64, usize) -> bool, landed: bool| {
                order[..at].iter().enumerate().find_map(|(k, other)| {
                    let theirs = if landed {
                        self.as_landed(*other)
                    } else {
                        self.changesets[other].clone()
                    };
                    (follows(*sid, k) && !mine.clashes_with(&theirs).is_empty())
                        .then_some((*other, theirs))
                })
            };
            match self.ended[sid] {
                Ended::Merged if overlap(&may_follow, false).is_none() => {
                    return Err(format!(
                        "session {sid} merged although nothing that landed between its lease and it touched its files: {:?}",
                        self.changesets[sid]
                    ));
                }
                Ended::Committed => {
                    if let Some((other, theirs)) = overlap(&surely_follows, true) {
                        return Err(format!(
                            "session {sid} committed without a merge although session {other}, which landed between its lease and it, touched its files: {:?}; session {other}: {theirs:?}",
                            self.changesets[sid]
                        ));
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Where two trees differ, for a failure message (at most 8 paths).
pub fn tree_diff(got: &Tree, want: &Tree) -> String {
    let paths: BTreeSet<&String> = got.keys().chain(want.keys()).collect();
    let mut out = Vec::new();
    for p in paths {
        let (g, w) = (got.get(p), want.get(p));
        if g != w {
            out.push(format!("{p}: got {g:?}, the model has {w:?}"));
        }
    }
    let n = out.len();
    out.truncate(8);
    if n > 8 {
        out.push(format!("… {} more", n - 8));
    }
    out.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deleting_what_another_deleted_is_no_clash() {
        let a = Changeset {
            edits: vec![(22, 8, "a".into())],
            deletes: vec![15],
            ..Changeset::default()
        };
        let b = Changeset {
            deletes: vec![15],
            ..Changeset::default()
        };
        assert!(a.clashes_with(&b).is_empty());
        assert!(b.clashes_with(&a).is_empty());
        let c = Changeset {
            edits: vec![(15, 0, "c".into())],
            deletes: vec![22],
            ..Changeset::default()
        };
        assert_eq!(a.clashes_with(&c), BTreeSet::from([15, 22]));
        let d = Changeset {
            creates: vec![(15, vec!["d".into()])],
            ..Changeset::default()
        };
        assert_eq!(b.clashes_with(&d), BTreeSet::from([15]));
        // The check the reliability test failed on (seed 1796601360156401791):
        // a plain commit after a delete of the same file is what the gate does.
        let mut race = Race::default();
        race.add(1, b.clone(), Ended::Committed).unwrap();
        race.add(2, a.clone(), Ended::Committed).unwrap();
        race.check_outcomes(&[1, 2], |_, _| true, |_, _| true)
            .unwrap();
        let mut race = Race::default();
        race.add(1, c, Ended::Committed).unwrap();
        race.add(2, a, Ended::Committed).unwrap();
        assert!(race
            .check_outcomes(&[1, 2], |_, _| true, |_, _| true)
            .is_err());
    }

    #[test]
    fn a_delete_of_a_file_already_gone_clashes_with_nothing_after_it() {
        // Seed 1796656759124255257: 1 deletes f15; 2, which leased the seed,
        // deletes it too (a delete that changes nothing); 3 leased after 1
        // (f15 gone), creates it and commits clean after 2 landed.
        let seed = seed_tree();
        let del = || Changeset {
            deletes: vec![15],
            ..Changeset::default()
        };
        let create = |v: &str| Changeset {
            creates: vec![(15, vec![v.into()])],
            ..Changeset::default()
        };
        let after_1 = |sid: i64, k: usize| sid != 3 || k >= 1;
        let mut race = Race::default();
        race.add(1, del(), Ended::Committed).unwrap();
        race.add(2, del(), Ended::Committed).unwrap();
        race.add(3, create("3"), Ended::Committed).unwrap();
        race.replay(&[1, 2, 3], &seed, |_, _| {}).unwrap();
        assert_eq!(race.void_deletes[&2], BTreeSet::from([15]));
        race.check_outcomes(&[1, 2, 3], after_1, after_1).unwrap();
        // A create that landed between its lease and it does clash (2 and 3
        // both leased after 1).
        let after_1 = |sid: i64, k: usize| sid == 1 || k >= 1;
        let mut race = Race::default();
        race.add(1, del(), Ended::Committed).unwrap();
        race.add(2, create("2"), Ended::Committed).unwrap();
        race.add(3, create("3"), Ended::Committed).unwrap();
        race.replay(&[1, 2, 3], &seed, |_, _| {}).unwrap();
        let e = race
            .check_outcomes(&[1, 2, 3], after_1, after_1)
            .unwrap_err();
        assert!(
            e.contains("session 3 committed") && e.contains("session 2"),
            "{e}"
        );
    }

    #[test]
    fn a_changeset_writes_what_it_applies() {
        let base = seed_tree();
        for i in 0..200 {
            let mut rng = Rng::for_publisher(7, i);
            let c = Changeset::draw(&mut rng, i, &base);
            let mut want = base.clone();
            c.apply(&mut want).unwrap();
            let mut got = base.clone();
            for w in c.writes(&base) {
                match w {
                    Write::File(p, b) => {
                        got.insert(p, lines_of(&b));
                    }
                    Write::Delete(p) => {
                        assert!(got.remove(&p).is_some(), "{p}");
                    }
                }
            }
            assert_eq!(got, want, "{c:?}");
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(serde_json::from_str::<Changeset>(&json).unwrap(), c);
        }
    }

    #[test]
    fn a_replay_refuses_a_lost_or_repeated_changeset() {
        let mut race = Race::default();
        let c = |p: &str| Changeset {
            own: Some(p.into()),
            ..Default::default()
        };
        race.add(1, c("own/p1.txt"), Ended::Committed).unwrap();
        race.add(2, c("own/p2.txt"), Ended::Merged).unwrap();
        assert!(race.add(3, c("own/p3.txt"), Ended::Rejected).is_err());
        let seed = seed_tree();
        assert!(race.replay(&[1], &seed, |_, _| {}).is_err());
        assert!(race.replay(&[1, 2, 1], &seed, |_, _| {}).is_err());
        let t = race.replay(&[2, 1], &seed, |_, _| {}).unwrap();
        assert_eq!(t.len(), FILES + 2);
    }
}
