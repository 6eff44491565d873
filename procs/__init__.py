"""The plumbing between moestream's processes: the messages the launcher and the compute process exchange
(`procs.messages`), how any of the processes is started and tied to its parent (`procs.spawn`), and how often
one that dies may be restarted (`procs.restart_budget`). A library:
it imports no process package, and names none of them."""
