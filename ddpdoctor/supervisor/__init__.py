"""The supervisor: the only part of ddpdoctor that talks to live processes."""
