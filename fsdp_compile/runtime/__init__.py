"""What compiled and eager steps call at run time: the collective and marker ops (``ops``), the memory plan's slabs
and slots (``slots``), the copy-engine collectives (``copy_engine``) and their streams (``streams``), and the failure
channels with the interruptible gloo waits (``channel``, ``channels``, ``gloo_wait``). Graph passes and lowerings
put these ops into graphs; nothing here reads or rewrites a graph."""
