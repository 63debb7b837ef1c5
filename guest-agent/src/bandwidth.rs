//! Bandwidth caps from pod annotations (`kubernetes.io/egress-bandwidth`,
//! `kubernetes.io/ingress-bandwidth`), as the CNI bandwidth plugin reads them:
//! a Kubernetes quantity in bits per second (`500M`, `1G`, `10Mi`, `1.5e6`).

pub const EGRESS: &str = "kubernetes.io/egress-bandwidth";
pub const INGRESS: &str = "kubernetes.io/ingress-bandwidth";

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum QuantityError {
    #[error("empty")]
    Empty,
    #[error("{0:?} is not a number with an optional suffix (k, M, G, T, P, E, Ki, Mi, Gi, Ti, Pi, Ei, m)")]
    Syntax(String),
    #[error("{0:?} is negative")]
    Negative(String),
}

/// Parses a Kubernetes resource quantity into a plain number.
pub fn parse_quantity(s: &str) -> Result<f64, QuantityError> {
    let s = s.trim();
    if s.is_empty() {
        return Err(QuantityError::Empty);
    }
    let bad = || QuantityError::Syntax(s.to_string());
    // the number part: digits, one dot, optional leading sign
    let num_end = s
        .char_indices()
        .find(|&(i, c)| !(c.is_ascii_digit() || c == '.' || ((c == '+' || c == '-') && i == 0)))
        .map(|(i, _)| i)
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(num_end);
    if num.is_empty() || num == "+" || num == "-" || num.matches('.').count() > 1 {
        return Err(bad());
    }
    let value: f64 = num.parse().map_err(|_| bad())?;
    let mult = match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024f64,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        e if (e.starts_with('e') || e.starts_with('E')) && e.len() > 1 => {
            let exp: i32 = e[1..].parse().map_err(|_| bad())?;
            10f64.powi(exp)
        }
        _ => return Err(bad()),
    };
    let v = value * mult;
    if v < 0.0 {
        return Err(QuantityError::Negative(s.to_string()));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("500M"), Ok(500e6));
        assert_eq!(parse_quantity("1G"), Ok(1e9));
        assert_eq!(parse_quantity("10Mi"), Ok(10.0 * 1024.0 * 1024.0));
        assert_eq!(parse_quantity("1.5G"), Ok(1.5e9));
        assert_eq!(parse_quantity("100k"), Ok(100e3));
        assert_eq!(parse_quantity("1e6"), Ok(1e6));
        assert_eq!(parse_quantity("2E3"), Ok(2e3));
        assert_eq!(parse_quantity(" 42 "), Ok(42.0));
        assert_eq!(parse_quantity(""), Err(QuantityError::Empty));
        assert!(matches!(
            parse_quantity("50X"),
            Err(QuantityError::Syntax(_))
        ));
        assert!(matches!(parse_quantity("M"), Err(QuantityError::Syntax(_))));
        assert!(matches!(
            parse_quantity("1.2.3M"),
            Err(QuantityError::Syntax(_))
        ));
        assert!(matches!(
            parse_quantity("-5M"),
            Err(QuantityError::Negative(_))
        ));
        assert!(matches!(
            parse_quantity("fast"),
            Err(QuantityError::Syntax(_))
        ));
        assert!(parse_quantity("50X")
            .unwrap_err()
            .to_string()
            .contains("\"50X\""));
    }
}
