//! `payledger-tools` run as its users run it, as a separate process: the storm under every fault
//! kind (`storm`), and the progress the long commands show (`progress`). One test binary, so the
//! tools and their dependencies are linked once for both.

mod progress;
mod storm;
