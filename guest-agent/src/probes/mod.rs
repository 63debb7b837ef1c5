pub mod sched {
    include!(concat!(env!("OUT_DIR"), "/sched.skel.rs"));
}
pub mod tcp {
    include!(concat!(env!("OUT_DIR"), "/tcp.skel.rs"));
}
