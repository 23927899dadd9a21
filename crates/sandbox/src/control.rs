//! The caller's hold on a running command in a conversation (see [`crate::Sandbox::run_with_control`]): stopping and
//! continuing its process group, reading how much CPU it has used or wanted, and its wall clock, which does not run
//! while the caller holds the command stopped.

use std::time::{Duration, Instant};

use crate::sys;

/// The caller's hold on a running command in a conversation (see [`crate::Sandbox::run_with_control`]).
#[derive(Debug)]
pub struct Control {
    /// The command's process group, to stop and continue it.
    pub group: libc::pid_t,
    /// The command's own user and group, when it has one: its signals reach every process of that user too (one that
    /// left the group with `setsid`).
    user: Option<(u32, u32)>,
    clock: tokio::sync::watch::Sender<Clock>,
}

/// The command's wall clock: time spent stopped by the caller does not count against its limit.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Clock {
    held_since: Option<Instant>,
    held: Duration,
}

impl Control {
    pub(crate) fn new(group: libc::pid_t, user: Option<(u32, u32)>, clock: tokio::sync::watch::Sender<Clock>) -> Self {
        Self { group, user, clock }
    }

    /// Stops the command's process group (`SIGSTOP`) and its wall clock: it waits for the caller and does no work.
    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
        self.hold_clock();
    }

    /// Restarts the command's wall clock and continues its process group (`SIGCONT`) after [`Control::stop`].
    pub fn resume(&self) {
        self.release_clock();
        self.signal(libc::SIGCONT);
    }

    /// Stops the command's wall clock only, for a command that waits for the caller but must not be stopped by a signal
    /// (one run under a program that follows its child's stops, such as Nsight Compute, which reports a stopped and
    /// continued child as ended with status 18).
    pub fn hold_clock(&self) {
        self.clock.send_if_modified(|clock| {
            let starts = clock.held_since.is_none();
            clock.held_since.get_or_insert_with(Instant::now);
            starts
        });
    }

    /// Restarts the command's wall clock after [`Control::hold_clock`].
    pub fn release_clock(&self) {
        self.clock.send_if_modified(|clock| match clock.held_since.take() {
            Some(since) => {
                clock.held += since.elapsed();
                true
            }
            None => false,
        });
    }

    /// Kills the command's process group (`SIGKILL`): for a command that broke the conversation's protocol. Only while the
    /// command is known to be running (it has just spoken), so the group cannot have been reused.
    pub fn kill(&self) {
        self.signal(libc::SIGKILL);
    }

    /// A reader of the command's processes in `/proc`, to use off the async runtime: on a host starved of CPU (the
    /// mass exit of a fork bomb's processes), one read of a process's `stat` has taken seconds.
    pub fn processes(&self) -> Processes {
        Processes { group: self.group, uid: self.user.map(|(uid, _)| uid) }
    }

    fn signal(&self, signal: libc::c_int) {
        // A group already gone is fine.
        sys::signal_group(self.group, signal);
        if let Some((uid, gid)) = self.user {
            sys::signal_all_as_user(uid, gid, signal);
        }
    }
}

/// The processes of a command's group, as `/proc` shows them (see [`Control::processes`]). Where the command runs
/// as a user of its own, only that user's entries of `/proc` are read (and root's: a process that made itself
/// undumpable shows as root's), so that the cost of a reading, and what can slow it, is the command's own and not
/// every process's on the host.
#[derive(Debug, Clone, Copy)]
pub struct Processes {
    group: libc::pid_t,
    uid: Option<u32>,
}

impl Processes {
    /// How long the command's process group has wanted a CPU so far: the CPU time it used (its processes' own, and
    /// that of the children the group's leader waited for) plus the time its threads waited runnable in a run
    /// queue (`/proc/<pid>/task/<tid>/schedstat`), so that a process starved by others on a loaded machine still
    /// counts as busy, not as waiting. `None` where `/proc` does not say. Blocking.
    pub fn cpu_demand(&self) -> Option<Duration> {
        let ticks = sys::clock_ticks()?;
        let members = self.members();
        if members.is_empty() {
            return None;
        }
        let mut cpu_ticks = 0u64;
        let mut waited_ns = 0u64;
        for (pid, fields) in &members {
            // After the state: ppid pgrp ... utime(11) stime(12) cutime(13) cstime(14).
            let field = |index: usize| fields.get(index).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
            cpu_ticks += field(11) + field(12);
            if *pid == self.group {
                cpu_ticks += field(13) + field(14);
            }
            for task in tasks(*pid) {
                let Ok(schedstat) = std::fs::read_to_string(task.join("schedstat")) else { continue };
                // on-CPU ns, run-queue wait ns, time slices
                waited_ns += schedstat.split_whitespace().nth(1).and_then(|w| w.parse::<u64>().ok()).unwrap_or(0);
            }
        }
        Some(Duration::from_secs_f64(cpu_ticks as f64 / ticks as f64) + Duration::from_nanos(waited_ns))
    }

    /// What the command's threads are doing now, for a report: each one's state and, for one asleep, where in the
    /// kernel it waits (`wchan`), counted, most common first: `3 S futex_do_wait, 1 S unix_stream_read_generic`.
    /// Empty where `/proc` does not say. Blocking.
    pub fn thread_states(&self) -> String {
        let mut counts: Vec<(String, usize)> = Vec::new();
        for (pid, _) in self.members() {
            for task in tasks(pid) {
                let Ok(stat) = std::fs::read_to_string(task.join("stat")) else { continue };
                let Some(state) = stat.rsplit_once(") ").and_then(|(_, fields)| fields.split_whitespace().next())
                else {
                    continue;
                };
                let wchan = std::fs::read_to_string(task.join("wchan")).unwrap_or_default();
                let what = match wchan.trim() {
                    "" | "0" => state.to_owned(),
                    wchan => format!("{state} {wchan}"),
                };
                match counts.iter_mut().find(|(seen, _)| *seen == what) {
                    Some((_, count)) => *count += 1,
                    None => counts.push((what, 1)),
                }
            }
        }
        counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        counts.iter().map(|(what, count)| format!("{count} {what}")).collect::<Vec<_>>().join(", ")
    }

    /// The group's processes now, each with the fields of its `stat` from the state on.
    fn members(&self) -> Vec<(libc::pid_t, Vec<String>)> {
        use std::os::unix::fs::MetadataExt;
        let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
        entries
            .flatten()
            .filter_map(|entry| {
                let pid = entry.file_name().to_str()?.parse::<libc::pid_t>().ok()?;
                if let Some(uid) = self.uid {
                    let owner = entry.metadata().ok()?.uid();
                    if owner != uid && owner != 0 {
                        return None;
                    }
                }
                let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
                // The command name is in parentheses and may hold spaces; the fields after it are numbers.
                let (_, fields) = stat.rsplit_once(')')?;
                let fields: Vec<String> = fields.split_whitespace().map(str::to_owned).collect();
                (fields.get(2)?.parse::<libc::pid_t>().ok()? == self.group).then_some((pid, fields))
            })
            .collect()
    }
}

/// The `/proc` directories of process `pid`'s threads.
fn tasks(pid: libc::pid_t) -> Vec<std::path::PathBuf> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks.flatten().map(|task| task.path()).collect()
}

/// Resolves when the command has run `wall` since `started`, not counting the time its clock was held.
pub(crate) async fn deadline(wall: Duration, started: Instant, mut clock: tokio::sync::watch::Receiver<Clock>) {
    loop {
        let now = *clock.borrow_and_update();
        if now.held_since.is_some() {
            if clock.changed().await.is_err() {
                return std::future::pending().await;
            }
            continue;
        }
        tokio::select! {
            () = tokio::time::sleep_until((started + wall + now.held).into()) => return,
            changed = clock.changed() => {
                if changed.is_err() {
                    // The caller's side is gone: the clock runs on as it stood.
                    tokio::time::sleep_until((started + wall + now.held).into()).await;
                    return;
                }
            }
        }
    }
}

/// Whether every process of the process group `group` is stopped, as [`Control::stop`] leaves it: each stopped
/// itself (`T`), or waiting uninterruptibly (`D`) for a child stopped before its exec (a shell starts a command with
/// vfork, and a vfork parent waits so for as long as its child is stopped). False for a group with no process.
pub fn group_stopped(group: libc::pid_t) -> bool {
    let group = group.to_string();
    let states: Vec<char> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| std::fs::read_to_string(entry.path().join("stat")).ok())
        .filter_map(|stat| {
            // After the command's name: state, parent, process group.
            let (_, fields) = stat.rsplit_once(") ")?;
            let mut fields = fields.split_whitespace();
            let state = fields.next()?.chars().next()?;
            (fields.nth(1)? == group).then_some(state)
        })
        .collect();
    states.contains(&'T') && states.iter().all(|state| matches!(state, 'T' | 'D'))
}
