# frozen_string_literal: true

require_relative '../../../puppet_x/vmhost/backup'

# Makes a VM from a backup in vmhostd's paths.backups (vm.import) when the catalog is
# compiled, and returns vm.create's mutation {changed, vm}. Every rule is vmhostd's: a VM of
# that name that exists is 2001 on `name`, a file whose sha256 is not the manifest's 2003 on
# `backup` (nothing left); a refusal fails the compilation. It waits up to 6 hours (disk files
# are copied and hashed). Under --noop nothing is sent: it returns {noop, method, params}.
Puppet::Functions.create_function(:'vmhost::import') do
  # @param backup the backup directory's name (vmhost::export's `backup`)
  # @param opts name (the new VM's; default the exported VM's), state ('running' or
  #   'stopped'; default the exported spec's), socket; any other key is sent to vmhostd as a
  #   param as given
  # @return [Hash] vm.import's answer
  dispatch :import do
    param 'String[1]', :backup
    optional_param 'Hash[String[1], Data]', :opts
  end

  def import(backup, opts = {})
    PuppetX::Vmhost::Backup.function_call('vmhost::import', 'vm.import', { 'backup' => backup }, opts)
  end
end
