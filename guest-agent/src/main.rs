mod probes;
fn main() {}
