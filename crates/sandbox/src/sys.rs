//! Every raw system call of the sandbox, and so all of its `unsafe` code, in one place: what the child does to
//! itself between `fork` and `exec` ([`ChildSetup`]), signals to process groups, processes and a command user's
//! processes, and the few queries std has no safe call for.
//!
//! Between fork and exec only raw system calls on integers are made (no allocation, no lock), because the parent
//! is multi-threaded: the Landlock ruleset is built in the parent and only its file descriptor crosses.
#![allow(unsafe_code)]

use crate::Limits;

/// Clock ticks per second (`_SC_CLK_TCK`, the unit of `/proc/<pid>/stat`'s times); `None` where unknown.
pub(crate) fn clock_ticks() -> Option<u64> {
    // SAFETY: sysconf reads a constant.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|&ticks| ticks > 0)
}

/// Sends `signal` to process group `group`; a group already gone (ESRCH) is not an error to anyone here.
pub(crate) fn signal_group(group: libc::pid_t, signal: libc::c_int) {
    // SAFETY: killpg takes plain integers.
    unsafe {
        libc::killpg(group, signal);
    }
}

/// Gives the processes of group `group`, and of user `uid` where given, the lowest scheduling priority (nice 19)
/// before they are killed: a process's exit (tearing down its memory) runs at its own priority, and two thousand
/// exiting at nice 0 starved a 2-core host for seconds. Processes already gone are no error.
pub(crate) fn lowest_priority(group: libc::pid_t, uid: Option<u32>) {
    // SAFETY: setpriority takes plain integers.
    unsafe {
        libc::setpriority(libc::PRIO_PGRP, group as libc::id_t, 19);
        if let Some(uid) = uid {
            libc::setpriority(libc::PRIO_USER, uid, 19);
        }
    }
}

/// Sends `signal` to process `pid`; a process already gone (ESRCH) is not an error to anyone here.
pub(crate) fn signal_process(pid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: kill takes plain integers.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// Whether process `pid` is known to be gone (`kill(pid, 0)` fails with ESRCH).
pub(crate) fn process_gone(pid: libc::pid_t) -> bool {
    // SAFETY: kill with signal 0 only checks whether the process exists.
    unsafe { libc::kill(pid, 0) != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) }
}

/// The effective user id of this process.
pub(crate) fn effective_uid() -> u32 {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() }
}

/// Takes an exclusive lock on `file` without waiting (`flock`); `false` when another holds it.
pub(crate) fn try_lock_exclusive(file: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor the file owns.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// The CPUs this process may run on (its affinity), in order; empty where the kernel does not say.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is the empty set; sched_getaffinity writes only it, CPU_ISSET reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&cpu| libc::CPU_ISSET(cpu, &set)).collect()
    }
}

/// The Landlock abi of the running kernel (0 without Landlock).
pub(crate) fn landlock_abi() -> i64 {
    const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
    // SAFETY: landlock_create_ruleset with a null attribute and the version flag only returns a number.
    let abi = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    abi.max(0)
}

/// Sends `signal` to every process of `uid`, from a child that becomes that user: `kill(-1, signal)` reaches all
/// processes the caller may signal, which for a user without privileges are its own. Blocking for the child's
/// life (a fork, three system calls, an exit).
pub(crate) fn signal_all_as_user(uid: u32, gid: u32, signal: libc::c_int) {
    // SAFETY: after fork, the child makes only async-signal-safe system calls on integers and leaves with _exit;
    // the parent waits for it.
    unsafe {
        let pid = libc::fork();
        if pid == 0 {
            if libc::setgroups(0, std::ptr::null()) == 0
                && libc::setresgid(gid, gid, gid) == 0
                && libc::setresuid(uid, uid, uid) == 0
            {
                libc::kill(-1, signal);
            }
            libc::_exit(0);
        }
        if pid > 0 {
            let mut status = 0;
            while libc::waitpid(pid, &mut status, 0) < 0
                && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
            {}
        }
    }
}

/// What the child does to itself between fork and exec. Plain data only.
#[derive(Debug, Clone)]
pub(crate) struct ChildSetup {
    /// The command cgroup's `cgroup.procs`: the child moves itself in first, so everything it starts is counted.
    pub cgroup_procs_fd: Option<i32>,
    pub limits: Limits,
    pub network_namespace: bool,
    pub landlock_fd: Option<i32>,
    /// Becomes the child's descriptor 3.
    pub control_fd: Option<i32>,
    /// The command's own user and group, switched to once what needs root is done.
    pub user: Option<(u32, u32)>,
}

impl ChildSetup {
    /// Makes `command`'s child apply this setup to itself between fork and exec.
    pub(crate) fn install(self, command: &mut tokio::process::Command) {
        // SAFETY: `apply` makes only async-signal-safe system calls on plain integers it owns; it allocates nothing
        // and touches no lock, as required between fork and exec in a multi-threaded parent.
        unsafe {
            command.pre_exec(move || self.apply());
        }
    }

    fn apply(&self) -> std::io::Result<()> {
        let check = |result: libc::c_int| if result == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
        let limit = |resource, value: u64| {
            let rlimit = libc::rlimit { rlim_cur: value, rlim_max: value };
            // SAFETY: setrlimit reads the struct we pass and nothing else.
            check(unsafe { libc::setrlimit(resource, &rlimit) })
        };
        // SAFETY (all calls below): raw system calls on integers; no allocation, no locks.
        if let Some(fd) = self.cgroup_procs_fd {
            // "0": the writing process itself.
            if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
                return Err(std::io::Error::last_os_error());
            }
        }
        unsafe {
            check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0))?;
        }
        limit(libc::RLIMIT_CPU, self.limits.cpu_seconds)?;
        limit(libc::RLIMIT_FSIZE, self.limits.file_bytes)?;
        limit(libc::RLIMIT_NOFILE, self.limits.open_files)?;
        limit(libc::RLIMIT_CORE, 0)?;
        if self.limits.nice > 0 {
            // SAFETY: setpriority on this process, with integers.
            unsafe { check(libc::setpriority(libc::PRIO_PROCESS, 0, self.limits.nice))? };
        }
        if !self.limits.cpus.is_empty() {
            // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET and sched_setaffinity write and read only it.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                for &cpu in &self.limits.cpus {
                    libc::CPU_SET(cpu, &mut set);
                }
                check(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set))?;
            }
        }
        if self.network_namespace {
            unsafe { check(libc::unshare(libc::CLONE_NEWNET))? };
        }
        if let Some((uid, gid)) = self.user {
            // Binds a user, not root: counted over every process and thread of the command's user.
            limit(libc::RLIMIT_NPROC, self.limits.processes)?;
            unsafe {
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setresgid(gid, gid, gid))?;
                check(libc::setresuid(uid, uid, uid))?;
                libc::umask(0o002);
                // A change of user clears the parent-death signal.
                check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0))?;
            }
        }
        if let Some(fd) = self.landlock_fd {
            unsafe {
                allow_own_proc_dir(fd);
                check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
                let result = libc::syscall(libc::SYS_landlock_restrict_self, fd, 0u32);
                if result != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
        }
        // After Landlock: the ruleset may itself be descriptor 3, which the control channel replaces.
        if let Some(fd) = self.control_fd {
            const CONTROL: libc::c_int = 3;
            if fd == CONTROL {
                unsafe { check(libc::fcntl(fd, libc::F_SETFD, 0))? };
            } else if unsafe { libc::dup2(fd, CONTROL) } != CONTROL {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// `struct landlock_path_beneath_attr` of the kernel's uapi (packed).
#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// Lets the command read and write its own `/proc/<pid>`: a thread naming another thread writes
/// `/proc/self/task/<tid>/comm`, and the CUDA driver fails to start without it (error 304 at
/// `cudaGetDeviceCount`, seen on the H200 hosts). The rule must be added in the child: in the parent,
/// `/proc/self` is the parent. Best effort: without it the command runs as before, and a GPU command may fail to start.
unsafe fn allow_own_proc_dir(ruleset_fd: i32) {
    const WRITE_FILE: u64 = 1 << 1;
    const READ_FILE: u64 = 1 << 2;
    const READ_DIR: u64 = 1 << 3;
    const TRUNCATE: u64 = 1 << 14;
    const LANDLOCK_RULE_PATH_BENEATH: libc::c_int = 1;
    // SAFETY: open with a static C string, landlock_add_rule with a struct that lives across the call, close of
    // the descriptor opened here: raw system calls, no allocation.
    unsafe {
        let dir = libc::open(c"/proc/self".as_ptr(), libc::O_PATH | libc::O_CLOEXEC);
        if dir < 0 {
            return;
        }
        // Truncation is a right of its own from Landlock ABI 3; an older kernel refuses the bit, so retry without.
        for allowed_access in [WRITE_FILE | READ_FILE | READ_DIR | TRUNCATE, WRITE_FILE | READ_FILE | READ_DIR] {
            let rule = PathBeneathAttr { allowed_access, parent_fd: dir };
            let added = libc::syscall(
                libc::SYS_landlock_add_rule,
                ruleset_fd,
                LANDLOCK_RULE_PATH_BENEATH,
                &rule as *const PathBeneathAttr,
                0u32,
            );
            if added == 0 {
                break;
            }
        }
        libc::close(dir);
    }
}
