# frozen_string_literal: true

require_relative '../../../puppet_x/vmhost/guest'

# Runs a command as root in a VM's guest through vmhostd (vm.exec) when the catalog is compiled,
# and returns the daemon's answer: exit_code, signal, timed_out, duration_ms, stdout, stderr
# (each capped, with stdout_truncated/stderr_truncated), their byte counts, encoding and slot.
# The host's [agent] allow_exec must be true. No shell unless argv names one. Like
# vmhost::host_info it talks to the socket of the machine compiling the catalog (puppet apply
# on the hypervisor). A daemon refusal fails the compilation; a failing command does only with
# check => true.
Puppet::Functions.create_function(:'vmhost::guest_exec') do
  # @param name the VM
  # @param argv the program and its arguments
  # @param opts env (array of K=V, or a hash), cwd, stdin, timeout_s (default 60), max_output,
  #   encoding (text or base64), socket, check (fail unless the command exits 0)
  # @return [Hash] vm.exec's answer
  dispatch :guest_exec do
    param 'String[1]', :name
    param 'Array[String, 1, 256]', :argv
    optional_param 'Struct[{
      Optional[env] => Variant[Array[String], Hash[Pattern[/\A[A-Za-z_][A-Za-z0-9_]*\z/], String]],
      Optional[cwd] => Pattern[/\A\//],
      Optional[stdin] => String,
      Optional[timeout_s] => Integer[1, 86400],
      Optional[max_output] => Integer[0],
      Optional[encoding] => Enum[text, base64],
      Optional[socket] => String[1],
      Optional[check] => Boolean,
    }]', :opts
  end

  def guest_exec(name, argv, opts = {})
    PuppetX::Vmhost::Guest.exec(name, argv, opts)
  rescue PuppetX::Vmhost::Error => e
    raise Puppet::Error, "vmhost::guest_exec: #{e.message}"
  end
end
