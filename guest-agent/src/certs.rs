//! `gpufeed-guest certs init`: the deployment's certificates and configuration. The command
//! lives in the shared crate, since `gpufeed-host` offers it too (see
//! [`gpufeed_shared::certs`] for what it writes).

pub use gpufeed_shared::certs::{CertsCmd, CertsInitArgs};

/// Runs a `certs` subcommand.
pub fn run(cmd: CertsCmd) -> anyhow::Result<()> {
    Ok(gpufeed_shared::certs::run(cmd)?)
}
