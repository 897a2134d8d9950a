//! Imported bases: a stack made from a staged directory tree, with no
//! containerd involved (`layerstack base import`; ARCHITECTURE.md §2, "Base").
//!
//! The engine stages the flattened tree in `staging/` and computes its content
//! digest; [`Store::import_base`] then records it in ONE write transaction —
//! the layer row (kind `base`), the stack, its `stack_layers` row and the
//! default branch on the stack's empty root manifest — with the rename of the
//! staged directory into `l/<n>` as the only filesystem step inside it (as a
//! squash's commit does). Under that transaction the stack is looked up
//! first: a second import of the same content (another thread, another
//! store instance on the same database) finds it and records nothing; its
//! staged directory is removed after the transaction.
//!
//! Crash story: before the commit, nothing but a directory under `staging/`
//! (removed by the startup sweep) or, between the rename and the commit, an
//! `l/<n>` without a row (removed by the startup sweep too: it is kept while
//! in flight, never by a Cleanup sweep); after it, the whole base.
//!
//! Stack ids: `import:sha256:<hex>` (see [`import_stack_id`]). A containerd
//! stack is `<namespace>/<chainID>`, and a containerd namespace is
//! `[A-Za-z0-9]+([._-][A-Za-z0-9]+)*` (containerd `identifiers.Validate`): it
//! never holds a `:`, so no containerd stack id starts with `import:` nor can
//! equal one. An imported stack's `namespace` column is NULL (it belongs to
//! no containerd namespace) and its `base_digest` is the content digest.

use std::path::Path;

use rusqlite::OptionalExtension;
use tracing::{info, warn};

use crate::db::{write_on, Cached};
use crate::error::StoreError;
use crate::layers::insert_layer;
use crate::snapshots::is_digest;
use crate::stacks::{ensure_branch, ensure_stack, stack_base_layers};
use crate::{fs, Durability, LayerId, LayerKind, Store};

/// The prefix of an imported stack's id (the vocabulary crate's).
pub use layerstack_types::IMPORT_STACK_PREFIX;

/// The id of the stack whose base was imported with content digest `digest`
/// (`sha256:<hex>`): `import:sha256:<hex>`.
pub fn import_stack_id(digest: &str) -> String {
    format!("{IMPORT_STACK_PREFIX}{digest}")
}

/// Whether `stack` is an imported base's stack (not containerd's).
pub fn is_imported_stack(stack: &str) -> bool {
    stack.starts_with(IMPORT_STACK_PREFIX)
}

/// What [`Store::import_base`] recorded, or found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportedBase {
    /// `import:sha256:<hex>`.
    pub stack: String,
    /// The content digest, `sha256:<hex>`.
    pub digest: String,
    /// The stack's base layer.
    pub layer: LayerId,
    /// `false`: the stack existed (the same content was imported before);
    /// nothing was recorded and the staged directory was removed.
    pub created: bool,
}

impl Store {
    /// Records the staged tree `staged` (a directory directly under
    /// [`Store::staging_path`]) with content digest `digest` as the base of
    /// stack [`import_stack_id`]`(digest)`, with the default branch on its
    /// empty root manifest — or finds that stack (see the module docs).
    ///
    /// `staged` is consumed: renamed into `l/<n>` when the stack is created,
    /// removed otherwise (after the transaction), also on an error.
    ///
    /// Errors: `InvalidArgument` for a digest that is not `sha256:<64 hex>`
    /// or a directory outside staging; `Corrupt` when the existing stack has
    /// no base layer; `Io`, `Db`.
    pub fn import_base(&self, staged: &Path, digest: &str) -> Result<ImportedBase, StoreError> {
        let out = self.import_base_inner(staged, digest);
        if std::fs::symlink_metadata(staged).is_ok() {
            if let Err(e) = fs::remove_tree(staged) {
                warn!(path = %staged.display(), error = %e, "cannot remove an import's staged directory; the startup sweep will");
            }
        }
        out
    }

    fn import_base_inner(&self, staged: &Path, digest: &str) -> Result<ImportedBase, StoreError> {
        if !is_digest(digest) {
            return Err(StoreError::InvalidArgument(format!(
                "base digest {digest:?} is not sha256:<64 lowercase hex digits>"
            )));
        }
        if staged.parent() != Some(self.staging_path().as_path()) {
            return Err(StoreError::InvalidArgument(format!(
                "{} is not a directory of the store's staging directory {}",
                staged.display(),
                self.staging_path().display()
            )));
        }
        let stack = import_stack_id(digest);
        let mut conn = self.db.writer();
        let mut dst = None;
        // The new layer's directory appears (by rename) before its row commits:
        // in flight, so a concurrent sweep leaves it alone.
        let mut inflight = None;
        let out = write_on(&mut conn, |tx| {
            let exists: Option<i64> = tx
                .one("SELECT 1 FROM stacks WHERE id = ?1", [&stack], |r| r.get(0))
                .optional()?;
            if exists.is_some() {
                let layer = stack_base_layers(tx, &stack)?
                    .first()
                    .copied()
                    .ok_or_else(|| {
                        StoreError::corrupt(
                            "stack_layers",
                            &stack,
                            "an imported stack with no base layer",
                        )
                    })?;
                return Ok(ImportedBase {
                    stack: stack.clone(),
                    digest: digest.to_string(),
                    layer,
                    created: false,
                });
            }
            let layer = insert_layer(tx, LayerKind::Base, Some(&stack), None)?;
            inflight = Some(self.inflight.hold(crate::layer_rel(layer)));
            ensure_stack(tx, &stack, digest, None, &[layer])?;
            ensure_branch(tx, &stack, &self.default_branch, &self.default_branch)?;
            let to = self.layer_path(layer);
            dst = Some(to.clone());
            crate::failpoints::fail("import.before_rename", &self.root)
                .and_then(|()| std::fs::rename(staged, &to))
                .and_then(|()| match self.durability {
                    Durability::Durable => fs::fsync_dir(&self.root.join("l")),
                    Durability::Disposable => Ok(()),
                })
                .and_then(|()| crate::failpoints::fail("import.after_rename", &self.root))
                .map_err(|e| StoreError::io(staged, e))?;
            Ok(ImportedBase {
                stack: stack.clone(),
                digest: digest.to_string(),
                layer,
                created: true,
            })
        });
        drop(conn);
        drop(inflight);
        match out {
            Ok(b) => {
                if b.created {
                    info!(stack = %b.stack, layer.id = b.layer, "imported base");
                } else {
                    info!(stack = %b.stack, layer.id = b.layer, "base already imported");
                }
                Ok(b)
            }
            Err(e) => {
                // Rolled back: put the renamed tree back where the caller's
                // cleanup (and ours) finds it.
                if let Some(d) = dst {
                    if std::fs::symlink_metadata(&d).is_ok()
                        && std::fs::symlink_metadata(staged).is_err()
                    {
                        let _ = std::fs::rename(&d, staged);
                    }
                }
                Err(e)
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::{Arc, Barrier};

    use crate::{Store, StoreOptions, SweepMode};

    const DIGEST: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";

    fn tmp() -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix("ls-import-")
            .tempdir_in("/var/tmp")
            .unwrap()
    }

    /// A staged tree holding `etc/motd`.
    fn staged(s: &Store) -> std::path::PathBuf {
        let (dir, _guard) = s.staging_dir("import").unwrap();
        std::fs::create_dir(dir.join("etc")).unwrap();
        std::fs::write(dir.join("etc/motd"), b"hi\n").unwrap();
        dir
    }

    fn names(dir: &std::path::Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    fn base_rows(s: &Store) -> i64 {
        s.db.read(|c| {
            Ok(
                c.query_row("SELECT count(*) FROM layers WHERE kind = 'base'", [], |r| {
                    r.get(0)
                })?,
            )
        })
        .unwrap()
    }

    #[test]
    fn an_import_makes_a_stack_with_its_base_and_main_and_a_second_finds_it() {
        let t = tmp();
        let s = Store::open(&t.path().join("root"), &StoreOptions::default()).unwrap();
        let first = staged(&s);
        let b = s.import_base(&first, DIGEST).unwrap();
        assert!(b.created);
        assert_eq!(b.stack, format!("import:{DIGEST}"));
        assert!(!first.exists(), "the staged tree was renamed");
        let st = s.stacks().unwrap();
        assert_eq!(st.len(), 1);
        assert_eq!(
            (st[0].namespace.as_deref(), st[0].base_digest.as_str()),
            (None, DIGEST)
        );
        assert_eq!(st[0].base_layers, vec![b.layer]);
        let branches = s.branches(&b.stack).unwrap();
        assert_eq!(branches.len(), 1);
        assert_eq!((branches[0].name.as_str(), branches[0].depth), ("main", 0));
        let view = s.manifest_view(&b.stack, branches[0].head).unwrap();
        assert_eq!(view, vec![s.layer_path(b.layer)]);
        assert_eq!(std::fs::read(view[0].join("etc/motd")).unwrap(), b"hi\n");
        // The same content again: the same stack, nothing recorded, its
        // staged tree dropped.
        let second = staged(&s);
        let again = s.import_base(&second, DIGEST).unwrap();
        assert_eq!(
            (again.created, again.layer, &again.stack),
            (false, b.layer, &b.stack)
        );
        assert!(!second.exists());
        assert_eq!(base_rows(&s), 1);
        assert!(names(&s.staging_path()).is_empty());
        assert_eq!(names(&s.root().join("l")), [b.layer.to_string()]);
        // Named by its digest's prefix from any namespace.
        assert_eq!(
            s.resolve_stack("default", &DIGEST[..19])
                .unwrap()
                .as_deref(),
            Some(b.stack.as_str())
        );
        assert!(super::is_imported_stack(&b.stack));
        // A startup sweep keeps it; removing the stack lets GC free the base.
        drop(s);
        let s = Store::open(&t.path().join("root"), &StoreOptions::default()).unwrap();
        assert_eq!(s.stacks().unwrap().len(), 1);
        s.remove_stack(&b.stack, false).unwrap();
        let gc = s.gc(&[]).unwrap();
        assert_eq!(gc.layers, vec![b.layer]);
        assert!(names(&s.root().join("l")).is_empty());
    }

    #[test]
    fn bad_input_is_refused_and_its_staged_tree_dropped() {
        let t = tmp();
        let s = Store::open(&t.path().join("root"), &StoreOptions::default()).unwrap();
        let dir = staged(&s);
        let e = s.import_base(&dir, "sha256:xyz").unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument, "{e}");
        assert!(!dir.exists());
        let outside = t.path().join("elsewhere");
        std::fs::create_dir(&outside).unwrap();
        let e = s.import_base(&outside, DIGEST).unwrap_err();
        assert!(e.to_string().contains("staging directory"), "{e}");
        assert!(s.stacks().unwrap().is_empty());
        assert_eq!(base_rows(&s), 0);
    }

    #[test]
    fn concurrent_imports_of_one_content_make_one_base() {
        let t = tmp();
        let root = t.path().join("root");
        let s = Arc::new(Store::open(&root, &StoreOptions::default()).unwrap());
        // A second instance on the same root: another connection, like
        // another process.
        let other = Arc::new(
            Store::open(
                &root,
                &StoreOptions {
                    startup_sweep: false,
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let n = 8;
        let go = Arc::new(Barrier::new(n));
        let threads: Vec<_> = (0..n)
            .map(|i| {
                let s = if i % 2 == 0 { s.clone() } else { other.clone() };
                let dir = staged(&s);
                let go = go.clone();
                std::thread::spawn(move || {
                    go.wait();
                    s.import_base(&dir, DIGEST).unwrap()
                })
            })
            .collect();
        let got: Vec<_> = threads.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(got.iter().filter(|b| b.created).count(), 1, "{got:?}");
        assert!(got
            .iter()
            .all(|b| b.layer == got[0].layer && b.stack == got[0].stack));
        assert_eq!(base_rows(&s), 1);
        assert!(
            names(&s.staging_path()).is_empty(),
            "every other staged tree is dropped"
        );
        assert_eq!(names(&root.join("l")), [got[0].layer.to_string()]);
        let r = s.sweep_with(SweepMode::Cleanup).unwrap();
        assert!(r.removed.is_empty() && r.missing.is_empty(), "{r:?}");
    }

    #[test]
    fn the_startup_sweep_drops_what_an_import_left_before_its_commit() {
        let t = tmp();
        let root = t.path().join("root");
        let s = Store::open(&root, &StoreOptions::default()).unwrap();
        // A crash before the transaction: a staged tree; between the rename
        // and the commit: a layer directory without a row.
        let dir = staged(&s);
        std::fs::create_dir(root.join("l/77")).unwrap();
        drop(s);
        let s = Store::open(&root, &StoreOptions::default()).unwrap();
        assert!(!dir.exists());
        assert!(!root.join("l/77").exists());
        assert!(s.stacks().unwrap().is_empty());
    }

    /// Format 7 kept an imported base's namespace as `''` in a NOT NULL
    /// column; format 8 rebuilds `stacks` (other tables refer to it) and says
    /// NULL. Sessions and branches on the stack survive the rebuild.
    #[test]
    fn a_format_7_store_is_migrated_and_its_imported_stack_has_no_namespace() {
        let t = tmp();
        let root = t.path().join("root");
        let s = Store::open(&root, &StoreOptions::default()).unwrap();
        let b = s.import_base(&staged(&s), DIGEST).unwrap();
        let owner = crate::Owner::Sandbox { name: "m".into() };
        let (before, _, _) = s
            .create_session(
                &owner,
                &b.stack,
                &crate::LeaseTarget::Branch("main".into()),
                None,
            )
            .unwrap();
        drop(s);
        let db = rusqlite::Connection::open(root.join("store.db")).unwrap();
        db.execute_batch(crate::tests::TO_FORMAT_9).unwrap();
        db.execute_batch(
            "PRAGMA foreign_keys = OFF;
             CREATE TABLE s7 (id TEXT PRIMARY KEY, base_digest TEXT NOT NULL, namespace TEXT NOT NULL, created_ns INTEGER NOT NULL);
             INSERT INTO s7 SELECT id, base_digest, '', created_ns FROM stacks;
             DROP TABLE stacks; ALTER TABLE s7 RENAME TO stacks;
             ALTER TABLE sessions DROP COLUMN ignore_mtime;
             UPDATE meta SET value = '7' WHERE key = 'format_version';",
        )
        .unwrap();
        drop(db);
        let s = Store::open(&root, &StoreOptions::default()).unwrap();
        let st = s.stacks().unwrap();
        assert_eq!(st.len(), 1);
        assert_eq!(st[0].namespace, None, "'' became NULL");
        assert_eq!(s.session(before.id).unwrap().stack, b.stack);
        // The rebuilt table still takes part in foreign keys.
        let refused = s.db.write(|tx| {
            Ok(tx.execute(
                "INSERT INTO sessions(owner_kind, namespace, owner, stack, branch, state, created_ns, updated_ns) VALUES ('sandbox', '', 'x', 'no-such-stack', 'main', 'active', 0, 0)",
                [],
            )?)
        });
        assert!(
            refused.is_err(),
            "a session on a stack that does not exist is refused"
        );
        // And an empty namespace can no longer be written.
        let empty = s.db.write(|tx| {
            Ok(tx.execute(
                "INSERT INTO stacks(id, base_digest, namespace, created_ns) VALUES ('x', 'sha256:0', '', 0)",
                [],
            )?)
        });
        assert!(empty.is_err(), "namespace '' is refused: NULL says none");
    }
}
