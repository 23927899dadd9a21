//! A command's Landlock ruleset: what it may read (system paths and the paths it is given) and write (its scratch and
//! the directories it is given). Built in the parent, where allocation is allowed; only the ruleset's descriptor
//! crosses into the child, which restricts itself with it before exec ([`crate::sys::ChildSetup`]).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use landlock::{ABI, Access, AccessFs, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope, path_beneath_rules};

use crate::{Command, SYSTEM_READABLE, SandboxError};

/// The ruleset of `command` under Landlock `abi`, as the descriptor the child restricts itself with.
pub(crate) fn for_command(abi: ABI, command: &Command) -> Result<OwnedFd, SandboxError> {
    // Rules are opened by path; a path that does not exist on this host is simply not granted.
    let mut writable: Vec<&Path> = vec![&command.scratch, Path::new("/dev")];
    writable.extend(command.writable.iter().map(PathBuf::as_path));
    let mut readable: Vec<&Path> = SYSTEM_READABLE.iter().map(Path::new).collect();
    readable.extend(command.readable.iter().map(PathBuf::as_path));
    readable.retain(|p| p.exists());
    writable.retain(|p| p.exists());
    let ruleset = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))?
        // Kernels from Landlock abi 6: no signals to, and no abstract unix sockets of, processes outside the command
        // (the evaluator, other commands). Older kernels ignore it (best effort); the report says which.
        .scope(Scope::Signal | Scope::AbstractUnixSocket)?
        .create()?
        .add_rules(path_beneath_rules(readable, AccessFs::from_read(abi)))?
        .add_rules(path_beneath_rules(writable, AccessFs::from_all(abi)))?;
    let fd: Option<OwnedFd> = ruleset.into();
    fd.ok_or(SandboxError::LandlockUnsupported)
}
