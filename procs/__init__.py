"""The plumbing between moestream's processes: the messages the launcher and the compute process exchange
(`procs.messages`) and how any of the processes is started and tied to its parent (`procs.spawn`). A library:
it imports no process package, and names none of them."""
