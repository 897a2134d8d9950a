//! `layerstack push`: a graph node or a branch head to an OCI registry, by
//! the daemon (the admin RPC `Push`; docs/operations.md "Push and pull").
//!
//! Credentials: `--username` with `--password-stdin`, or `--registry-token`,
//! else the caller's docker `config.json` (`$DOCKER_CONFIG/config.json`, else
//! `~/.docker/config.json`: `auths`, `credHelpers`, `credsStore`) for the
//! reference's registry, sent with the request; with none of them the daemon
//! uses its own `[registry] docker_config`, else anonymous.

use std::io::Read as _;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;
use layerstack_api as api;
use layerstack_registry::{
    credentials_from_docker_config, docker_config_path, parse_reference, Credentials,
};
use serde_json::json;

use crate::errors::with_kind;

/// `layerstack push`.
#[derive(Debug, Clone, Args)]
pub struct PushArgs {
    /// REGISTRY[:PORT]/REPOSITORY[:TAG] to push to (`:latest` when no tag).
    pub reference: String,
    /// STACK[@BRANCH]: push this branch head [default branch: the daemon's]
    /// (a pull elsewhere lands it on that branch, or on `pull --branch`'s).
    #[arg(long, conflicts_with = "node")]
    pub stack: Option<String>,
    /// Push this graph node (its id is kept: a pull elsewhere makes the same node).
    #[arg(long, value_name = "ID")]
    pub node: Option<String>,
    /// Layer blob compression: gzip or zstd.
    #[arg(long, default_value = "gzip", value_parser = ["gzip", "zstd"])]
    pub compression: String,
    #[command(flatten)]
    pub auth: AuthArgs,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Registry credentials of `push` and `pull`.
#[derive(Debug, Clone, Args)]
pub struct AuthArgs {
    /// Registry user name (the password is read from stdin: --password-stdin).
    #[arg(long, requires = "password_stdin")]
    pub username: Option<String>,
    /// Read the registry password from stdin (one line).
    #[arg(long, requires = "username")]
    pub password_stdin: bool,
    /// A registry bearer token instead of a password, sent as
    /// `Authorization: Bearer TOKEN` (one the registry's token service issued;
    /// a config.json `identitytoken` is not one: leave it in config.json).
    #[arg(long, conflicts_with = "username", value_name = "TOKEN")]
    pub registry_token: Option<String>,
}

/// The credentials to send for `reference`: the flags', else the caller's
/// docker config's entry, else none (the daemon's own, or anonymous).
pub fn auth_for(a: &AuthArgs, reference: &str) -> Result<Option<api::RegistryAuth>> {
    if let Some(t) = &a.registry_token {
        return Ok(Some(api::RegistryAuth {
            token: t.clone(),
            ..Default::default()
        }));
    }
    if let Some(u) = &a.username {
        let mut line = String::new();
        std::io::stdin()
            .read_to_string(&mut line)
            .context("reading the password from stdin")?;
        return Ok(Some(api::RegistryAuth {
            username: u.clone(),
            password: line.trim_end_matches(['\n', '\r']).to_string(),
            ..Default::default()
        }));
    }
    let r = parse_reference(reference).map_err(|e| with_kind(e.kind(), anyhow::Error::new(e)))?;
    let Some(path) = docker_config_path() else {
        return Ok(None);
    };
    let creds = credentials_from_docker_config(&path, r.registry())
        .map_err(|e| with_kind(e.kind(), anyhow::Error::new(e)))?;
    Ok(match creds {
        Credentials::Anonymous => None,
        Credentials::Basic { username, password } => Some(api::RegistryAuth {
            username,
            password,
            ..Default::default()
        }),
        Credentials::Bearer(token) => Some(api::RegistryAuth {
            token,
            ..Default::default()
        }),
    })
}

/// Runs `layerstack push`.
pub async fn run(cli: &crate::Cli, a: PushArgs) -> Result<ExitCode> {
    if a.stack.is_none() && a.node.is_none() {
        return Err(crate::errors::failure(
            api::ErrorKind::InvalidArgument,
            "push needs what to push: --node ID (a graph node) or --stack STACK[@BRANCH] (a branch head)",
        ));
    }
    let auth = auth_for(&a.auth, &a.reference)?;
    let (stack, branch) = match &a.stack {
        Some(s) => crate::history::split_branch(s),
        None => (String::new(), String::new()),
    };
    let mut c = crate::connect(&cli.admin_address).await?;
    let r = c
        .push(api::PushRequest {
            node: a.node.clone().unwrap_or_default(),
            namespace: cli.namespace.clone(),
            stack,
            branch,
            reference: a.reference.clone(),
            auth,
            compression: a.compression.clone(),
        })
        .await?
        .into_inner();
    if a.json {
        println!(
            "{}",
            json!({
                "reference": r.reference,
                "manifest_digest": r.manifest_digest,
                "node": r.node,
                "stack": r.stack,
                "layers": r.layers,
                "blobs_sent": r.blobs_sent,
                "blobs_present": r.blobs_present,
                "bytes_sent": r.bytes_sent,
                "diff_ids": r.diff_ids,
                "layers_packed": r.layers_packed,
            })
        );
    } else {
        println!(
            "pushed {}{} as {}@{}: {}, {} sent ({} bytes), {} already there",
            if r.node.is_empty() { "" } else { "node " },
            if r.node.is_empty() { &r.stack } else { &r.node },
            r.reference,
            r.manifest_digest,
            count(r.layers.into(), "layer"),
            count(r.blobs_sent.into(), "blob"),
            r.bytes_sent,
            r.blobs_present
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `layerstack pull`.
#[derive(Debug, Clone, Args)]
pub struct PullArgs {
    /// REGISTRY[:PORT]/REPOSITORY[:TAG] or …@sha256:<hex>: an image
    /// `layerstack push` made (of a node, or of a branch head).
    pub reference: String,
    #[command(flatten)]
    pub auth: AuthArgs,
    /// Record a node new here in this graph instead of the one the image
    /// names (when this store has a graph of that name with another root).
    #[arg(long, value_name = "NAME")]
    pub graph: Option<String>,
    /// Point this branch of the stack at what was pulled: made when absent,
    /// else promoted onto (fast-forward, or a merge; a conflict is refused
    /// whole, exit 1, kind conflict). Default: a branch head's image lands
    /// on the branch it was pushed from; a node's on none.
    #[arg(long, value_name = "BRANCH", value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub branch: Option<String>,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `n thing` or `n things`.
fn count(n: u64, thing: &str) -> String {
    if n == 1 {
        format!("1 {thing}")
    } else {
        format!("{n} {thing}s")
    }
}

/// Runs `layerstack pull`.
pub async fn pull(cli: &crate::Cli, a: PullArgs) -> Result<ExitCode> {
    let auth = auth_for(&a.auth, &a.reference)?;
    let mut c = crate::connect(&cli.admin_address).await?;
    let r = c
        .pull(api::PullRequest {
            reference: a.reference.clone(),
            auth,
            graph: a.graph.clone().unwrap_or_default(),
            branch: a.branch.clone().unwrap_or_default(),
        })
        .await?
        .into_inner();
    if a.json {
        println!(
            "{}",
            json!({
                "node": r.node,
                "stack": r.stack,
                "graph": r.graph,
                "manifest_digest": r.manifest_digest,
                "created": r.created,
                "base_imported": r.base_imported,
                "layers": r.layers,
                "layers_fetched": r.layers_fetched,
                "layers_reused": r.layers_reused,
                "bytes_fetched": r.bytes_fetched,
                "missing_parents": r.missing_parents,
                "linked_children": r.linked_children,
                "branch": r.branch,
                "branch_result": r.branch_result,
                "branch_head": r.branch_head,
                "branch_session": r.branch_session.as_ref().map(|s| s.id),
            })
        );
    } else {
        let fetched = format!(
            "{} above the base, fetched {}, held here {}; {} bytes downloaded{}",
            count(r.layers.into(), "layer"),
            r.layers_fetched,
            r.layers_reused,
            r.bytes_fetched,
            if r.base_imported {
                "; base imported"
            } else {
                ""
            }
        );
        if r.node.is_empty() {
            println!(
                "pulled a head of stack {}: branch {} {} (head {}): {fetched}",
                r.stack, r.branch, r.branch_result, r.branch_head,
            );
            if let Some(s) = &r.branch_session {
                println!("merged by session {}", s.id);
            }
            return Ok(ExitCode::SUCCESS);
        }
        println!(
            "{} node {} of graph {} ({}): {fetched}",
            if r.created { "pulled" } else { "already had" },
            r.node,
            r.graph,
            r.stack,
        );
        if !r.missing_parents.is_empty() {
            println!(
                "parents not in this store (linked when pulled): {}",
                r.missing_parents.join(", ")
            );
        }
        if !r.linked_children.is_empty() {
            println!("linked as the parent of: {}", r.linked_children.join(", "));
        }
        if !r.branch.is_empty() {
            println!(
                "branch {} {} (head {})",
                r.branch, r.branch_result, r.branch_head
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
