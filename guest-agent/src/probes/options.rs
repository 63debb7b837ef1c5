//! Each unit's part of the command line, gathered from the registry.
//!
//! A unit declares its flags as a `clap::Args` struct beside its loader and
//! names it in its registry entry ([`OptionsSpec::of`]); `gpufeed-guest run`
//! flattens [`UnitOptions`], whose `clap` side (in `probes::registry`, which
//! lists the units) asks every unit of `probes::UNITS` for its flags and
//! parses them, and the unit's loader takes its own back with
//! [`UnitOptions::get`]. So adding a probe with a flag touches the probe's
//! unit and the registry line, not `main.rs` or a configuration type that
//! lists every unit.

use std::any::Any;
use std::fmt::Display;

use clap::{ArgMatches, Args, Command, FromArgMatches};

type Boxed = Box<dyn Any + Send + Sync>;

/// How a unit's options come from the command line.
#[derive(Debug, Clone, Copy)]
pub struct OptionsSpec {
    augment: fn(Command) -> Command,
    parse: fn(&ArgMatches) -> Result<Option<Boxed>, clap::Error>,
}

impl OptionsSpec {
    /// A unit without flags.
    pub const NONE: OptionsSpec = OptionsSpec {
        augment: no_flags,
        parse: no_options,
    };

    /// Flags `F` (a `clap::Args` struct) that make the unit's options `T`;
    /// a conversion that fails (flags valid alone but not together) is a
    /// command-line error, reported before anything loads.
    pub const fn of<F, T>() -> OptionsSpec
    where
        F: Args + FromArgMatches,
        T: TryFrom<F> + Send + Sync + 'static,
        T::Error: Display,
    {
        OptionsSpec {
            augment: F::augment_args,
            parse: parse::<F, T>,
        }
    }

    /// Flags that are the unit's options as they are.
    pub const fn flags<T>() -> OptionsSpec
    where
        T: Args + FromArgMatches + Send + Sync + 'static,
    {
        OptionsSpec::of::<T, T>()
    }

    /// Adds the unit's flags to `cmd`.
    pub fn add_flags(&self, cmd: Command) -> Command {
        (self.augment)(cmd)
    }
}

fn no_flags(cmd: Command) -> Command {
    cmd
}

fn no_options(_: &ArgMatches) -> Result<Option<Boxed>, clap::Error> {
    Ok(None)
}

fn parse<F, T>(m: &ArgMatches) -> Result<Option<Boxed>, clap::Error>
where
    F: FromArgMatches,
    T: TryFrom<F> + Send + Sync + 'static,
    T::Error: Display,
{
    let flags = F::from_arg_matches(m)?;
    let options = T::try_from(flags)
        .map_err(|e| clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{e}\n")))?;
    Ok(Some(Box::new(options)))
}

/// The options of every unit of the registry.
#[derive(Default)]
pub struct UnitOptions {
    values: Vec<Boxed>,
}

impl std::fmt::Debug for UnitOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UnitOptions({} units)", self.values.len())
    }
}

impl UnitOptions {
    /// A unit's options (its registry entry names their type).
    ///
    /// # Panics
    /// When no unit of the registry declares options of type `T`: a unit
    /// asking for options it did not register is a bug, not input.
    pub fn get<T: 'static>(&self) -> &T {
        self.values
            .iter()
            .find_map(|v| v.downcast_ref::<T>())
            .unwrap_or_else(|| {
                panic!(
                    "no unit registers options of type {}",
                    std::any::type_name::<T>()
                )
            })
    }

    /// Adds the options of the unit `spec` from the parsed command line (its
    /// flags' conversion may refuse them: a command-line error).
    pub fn parse_unit(&mut self, spec: &OptionsSpec, m: &ArgMatches) -> Result<(), clap::Error> {
        self.values.extend((spec.parse)(m)?);
        Ok(())
    }

    /// Replaces a unit's options (tests, and callers that load units for
    /// another purpose than `run`, such as the selftest).
    pub fn set<T: Send + Sync + 'static>(&mut self, options: T) {
        self.values.retain(|v| !v.is::<T>());
        self.values.push(Box::new(options));
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::probes::{cuda, nvml, sched, tcp};

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        units: UnitOptions,
    }

    /// Every unit's flags reach its options; a flag not given keeps the
    /// default; an invalid combination is an error of the command line.
    #[test]
    fn each_unit_gets_its_flags_from_one_command_line() {
        let cli = Cli::try_parse_from([
            "x",
            "--sched-method",
            "stamp",
            "--cuda-launches",
            "--dst",
            "cluster=10.42.0.0/16",
        ])
        .unwrap();
        assert_eq!(
            cli.units.get::<sched::Config>().method,
            sched::Method::Stamp
        );
        assert!(cli.units.get::<cuda::CudaOptions>().launches);
        assert_eq!(cli.units.get::<tcp::Options>().dst.name(0), "cluster");

        let defaults = UnitOptions::defaults();
        assert_eq!(defaults.get::<sched::Config>().method, sched::Method::Auto);
        assert!(!defaults.get::<cuda::CudaOptions>().launches);
        assert_eq!(defaults.get::<nvml::Config>().library, crate::nvml::LIBRARY);
        assert_eq!(defaults.get::<tcp::Options>().dst.name(0), "loopback");

        let e = Cli::try_parse_from(["x", "--dst", "cluster=10.0.0.0/33"]).unwrap_err();
        assert!(e.to_string().contains("--dst: "), "{e}");
        assert!(e.to_string().contains("10.0.0.0/33"), "{e}");
    }
}
