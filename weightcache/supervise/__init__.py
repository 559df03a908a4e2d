"""``weightcache supervise``: keep an engine's imports in a template process and fork each
engine from it, so a restart costs a fork instead of ``import torch, transformers``.

    weightcache supervise [--preload MODULES] [--record FILE [--exclude MODULES]] [--status FILE] -- python engine.py ARGS

In the spirit of gunicorn's ``--preload`` and Android's zygote. With the cache, an
engine's imports, not its weights, decide its restart time (on the H200 an
8B transformers engine spent 13.8-14.6 s of a 16.6-17.7 s restart importing; a forked
engine that found torch and transformers imported was ready in 0.36 s).

The supervisor (docs/deployment.md, "Supervisor"):

1. imports the ``--preload`` modules and those the last engine recorded (``--record``),
   never touching CUDA; checks that forking is safe (fork_safety.py);
2. forks the engine, which runs ``engine.py`` (or ``-m module``) as ``__main__`` with the
   argv, cwd, environment, stdio and signal state it would have had unsupervised;
3. when the engine exits, forks the next one: at once after a planned restart (exit
   status :data:`~weightcache.engine.RESTART_EXIT_CODE`, see
   :func:`weightcache.engine.restart`) or a first crash, with backoff after repeated
   crashes (:class:`~weightcache.supervise.policy.RestartPolicy`); exit status 0 means
   "finished" and stops the supervisor with 0;
4. passes signals through (SIGHUP, SIGUSR1, SIGUSR2, SIGWINCH), and on SIGTERM, SIGINT or
   SIGQUIT passes the signal on, waits up to ``--stop-timeout`` for the engine, SIGKILLs it
   if it is still there, then exits (0, or 1 when it had to kill); a second stop signal
   kills at once, unless it is the same signal from the same sender within a second (one
   request delivered to the process and to its group: :class:`~weightcache.systemd.StopRequests`);
5. reaps every child (it can be a container's PID 1) and logs each exit, its status and
   the restart counts to stderr, and to ``--status FILE`` as JSON.

It is single-threaded and waits with ``sigtimedwait``: signals are blocked in the
supervisor and taken one at a time, so none is lost between a check and a wait.

The rooms: command.py (the engine command, and running it in the child as ``python``
would), policy.py (an engine's exit, and when to restart it; pure), fork_safety.py
(whether the template may fork, and what the child resets), loop.py (the supervisor
process: preload, fork, wait, signals, status). The engine's side of the link is the
public :mod:`weightcache.engine` (``ready``, ``restart``), which engines import; it
stays a top-level module so that importing it never imports the supervisor.
"""

from .loop import SupervisorOptions, supervise

__all__ = ["SupervisorOptions", "supervise"]
