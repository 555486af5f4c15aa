# frozen_string_literal: true

require_relative '../../../puppet_x/vmhost/backup'

# Writes a VM's spec and disks to a new backup directory in vmhostd's paths.backups
# (vm.export) when the catalog is compiled, and returns the daemon's answer {backup, path,
# manifest}: `backup` is what vmhost::import takes. Every rule is vmhostd's (requires =>
# 'frozen' refused with 4094 rather than a crash-consistent copy; a refusal fails the
# compilation). Under --noop nothing is sent: it returns {noop, method, params}.
Puppet::Functions.create_function(:'vmhost::export') do
  # @param vm the VM
  # @param opts timeout_s (longest the copy may take; the daemon's default 3600), requires
  #   ('frozen'), socket; any other key (the backup options of a newer vmhostd) is sent to
  #   vmhostd as a param as given
  # @return [Hash] vm.export's answer
  dispatch :export do
    param 'String[1]', :vm
    optional_param 'Hash[String[1], Data]', :opts
  end

  def export(vm, opts = {})
    PuppetX::Vmhost::Backup.function_call('vmhost::export', 'vm.export', { 'name' => vm }, opts)
  end
end
